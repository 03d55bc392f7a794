"""Pure-decode steps replayed from CUDA graphs: one graph per padded batch size.

A Llama-3-8B decode step launches ~1,300 small kernels; from Python that takes 20-30 ms of host
time while the GPU needs 4-12 ms, so eager decode is bound by launches.  A captured graph
replays the whole forward with one launch.  A graph bakes in its tensors' addresses and its
host-side arguments, so every input lives in a static buffer here, padded to the batch size the
graph was captured for, and the host arguments are fixed upper bounds:

- ``max_query_len`` is 1 and ``query_start_loc`` is ``arange``: only pure decode steps qualify;
  prefill steps run eagerly (their shapes vary step to step).  Speculative decoding's verifying
  steps get graphs of their own (``query_len = 1 + k``, vLLM's ``uniform_decode_query_len``):
  every row a query of exactly 1 + k tokens, ``query_start_loc = arange * (1 + k)``; the
  per-token inputs are 1 + k per row, padding rows included.  Those graphs have no cascade and
  no chunked-local layers (a row's 1 + k queries may straddle a chunk boundary: two virtual
  batches), so such steps run eagerly.
- Chunked-local layers (Llama 4's iRoPE) read a decode step's virtual batches, which are its rows
  again (each query sits in one chunk): ``local_seqused_k`` [B] and ``local_block_table`` [B,
  chunk pages], with ``local_max_seq_len`` bounded by the chunk.  A plan with no local metadata
  (every key still in chunk 0) gets the rows' own lengths and first pages.
- ``max_seq_len`` is the model's ``max_position_embeddings``.  The kernels bound each row by
  ``seq_lens`` (FA3 sizes its KV splits on the device from them), so the bound costs nothing.
- Padding rows write nowhere (slot -1) and attend over one token of an existing block; their
  outputs are dropped.  Rows are independent through every layer, so padding never changes a
  real row.
- Cascade decode steps get graphs of their own, with the prefix groups padded to
  ``MAX_CASCADE_GROUPS``: a padded group has no queries, so the prefix pass skips it.  Without
  them a cascade step would run eagerly, bound by launches, and lose to the plain step it was
  meant to beat.

Staging.  Every static int input a graph reads (token ids, positions, slots, lengths, block
tables, the cascade groups) is a view into ONE int32 device buffer, and a pinned host mirror has
the same layout.  ``load`` writes the step into the mirror with numpy -- real rows and padding
rows alike -- and sends each span it touched with one non-blocking copy: one copy for a plain step
(the per-row vectors and the block table's used rows are adjacent), three for a cascade step.
Staging each array on its own cost a copy to the device plus a device-side copy into the static
buffer, and the padding rows a fill each: ~13 operations a plain step, ~25 a cascade one, each a
launch's worth of host time in a step whose replay is one launch.

- A table's span is rows [0, b) at the full width W (``max_position_embeddings`` over the block
  size), of which a step uses w columns.  When that would send mostly unused columns (more than
  ``max_unused`` ints, and at least 3/4 of the span: a narrow step of a long-context model's
  table runs to megabytes), the table goes compact into a stage area at the buffer's end instead,
  sent with one more copy, and one device copy puts it in place: one launch, not MBs over PCIe
  on the stream ahead of the replay.
- The mirror's contents, not the device's, are the truth: a span goes over whole, so every value
  in it that the graph reads is written by every ``load`` (padding rows included).  Values it
  does not read may be stale: rows from ``n`` on (the graph for ``n`` stops there), block-table
  columns past a row's ``seq_len``, the cascade fields on a plain step.
- Padding rows get token 0 at position 0 too, not what the mirror kept from an earlier step:
  under async scheduling a plan's ids may be -1 placeholders that the worker patches on the
  device only, after ``load`` (``graphs.input_ids[i] = ...``), and the mirror never sees that.
- Padding rows' block-table rows are not sent: they keep ids an earlier step wrote (or 0), which
  name existing blocks, and with ``seq_len`` 1 only the first one is read.
- Token ids and positions are int32 like the rest (``F.embedding`` takes int32 indices, and the
  RoPE table gather converts them on the device), so they share the buffer.
- Two mirrors in turn, each with an event recorded after its copies: a mirror is written again
  only once its last copy has read it (the host may run a step ahead of the device).

On CPU the same padded path runs eagerly (``capture=False``), which is how the tests check the
padding logic without a GPU; the device buffer is then the mirror itself and nothing is copied,
unless ``staged=True`` asks for the GPU's two-mirror path with CPU copies (tests use it to check
the copied spans).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import torch

from ray_attn.metadata import FlashAttentionMetadata, LocalAttentionMetadata

MAX_CASCADE_GROUPS = 32
# Verifying steps' graphs stop at 64 rows: on an H200 a plain step of 64 x 1k already costs 1.6x
# one of a single row, so speculation gains little beyond it (bench_spec_verify.py)
SPEC_GRAPH_MAX_BATCH = 64
_ALIGN = 64  # int32 elements (256 bytes, as cudaMalloc aligns): every view starts aligned
_MIRRORS = 2  # host mirrors used in turn when staged (see the module docstring)


def _layout(B: int, G: int, W: int, P: int, q: int = 1) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """The static int inputs in buffer order.  The per-row vectors (and the chunked-local table,
    [B, P] with P = 0 for models without chunked layers) come first and are sent whole (a few
    KiB), so that with the block table's used rows right after them a plain step's whole input is
    one contiguous span; the cascade tables come last, sent only on cascade steps."""
    return (("input_ids", (B * q,)), ("positions", (B * q,)), ("slot_mapping", (B * q,)), ("seq_lens", (B,)),
            ("suffix_kv_lens", (B,)), ("cu_prefix_query_lens", (G + 1,)), ("prefix_kv_lens", (G,)),
            ("local_seqused_k", (B,)), ("local_block_table", (B, P)), ("block_table", (B, W)), ("suffix_block_table", (B, W)), ("prefix_block_table", (G, W)),
            # Compact tables (see ``_table``): each is at most 1/4 of its full-width rows.
            ("_stage", ((2 * B + G) * W // 4,)))


# Values the buffers start with (0 elsewhere): padding-row values, so that any size's graph sees
# valid metadata from the start (capture's warm-up runs on them).
_INITIAL = {"slot_mapping": -1, "seq_lens": 1, "suffix_kv_lens": 1, "prefix_kv_lens": 1,
            "local_seqused_k": 1}


def wants_cuda_graphs(parallel, kernel: str) -> bool:
    """Whether a rank captures decode graphs (given a GPU): the flash kernels only, since the torch
    reference kernel reads lengths on the host; 'auto' and 'on' at any TP size (TP=2 decode steps
    captured with the NCCL all-reduce inside give HF's tokens: scripts/gpu_accuracy.py, row
    tp2_graphs). 'on' differs from 'auto' in failing loudly when a capture fails."""
    return kernel in ("fa3", "fa2") and parallel.cuda_graphs != "off"


def decode_num_splits(batch: int, num_kv_heads: int, num_sms: int) -> int:
    """FlashAttention 3's KV split count for a decode graph of ``batch`` rows.  A graph is
    captured with ``max_seqlen_k`` at the model's limit, and FA3 sizes its splits on the host from
    that bound, as if every row were that long: on an H200 at 256 x 1k that cost 11% (303 -> 336
    us a layer) and at 64 x 4k 5%.  Once the batch gives every SM a (row, KV head) tile, splitting
    only adds a combine pass, and one split was the fastest at every such point we measured
    (``scripts/probe_fa3_splits.py``); below that, FA3's own heuristic (0) keeps long rows
    spread over the SMs."""
    return 1 if batch * num_kv_heads >= num_sms else 0


def batch_sizes(max_batch: int) -> list[int]:
    """The padded sizes we capture: fine steps where padding would waste most (vLLM's scheme)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    # Views into the one int32 device buffer, in ``_layout`` order (set by __init__).  The worker
    # reads ``input_ids`` and may patch rows of it on the device after ``load``.
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    suffix_kv_lens: torch.Tensor
    cu_prefix_query_lens: torch.Tensor
    prefix_kv_lens: torch.Tensor
    block_table: torch.Tensor
    suffix_block_table: torch.Tensor
    prefix_block_table: torch.Tensor
    local_seqused_k: torch.Tensor
    local_block_table: torch.Tensor

    def __init__(self, model, max_batch: int, device: torch.device, capture: bool = True,
                 staged: bool | None = None, query_len: int = 1, pool=None):
        if max_batch < 1:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        if query_len < 1:
            raise ValueError(f"query_len must be positive, got {query_len}")
        q = self.query_len = query_len  # tokens per row: 1, or 1 + k for verifying steps
        self.model, self.device = model, torch.device(device)
        self.sizes = batch_sizes(max_batch)
        B = self.sizes[-1]
        self.max_seq_len = model.config.max_position_embeddings
        width = -(-self.max_seq_len // model.block_size)
        i32 = dict(dtype=torch.int32, device=self.device)
        # staged: a separate device buffer fed from host mirrors (needed on CUDA; optional on CPU).
        self.staged = self.device.type != "cpu" if staged is None else bool(staged)
        if not self.staged and self.device.type != "cpu":
            raise ValueError(f"staged=False needs a CPU device (numpy writes the buffer), got {self.device}")
        self._width = width
        cfg = model.config
        self.chunk = cfg.attention_chunk_size if "chunked_attention" in cfg.layer_kinds() else None
        if self.chunk and q > 1:
            raise ValueError("graphs of multi-token queries do not cover chunked-local layers")
        pages = self.chunk // model.block_size if self.chunk else 0
        self._offset: dict[str, tuple[int, tuple[int, ...]]] = {}
        size = 0
        for name, shape in _layout(B, MAX_CASCADE_GROUPS, width, pages, q):
            size = -(-size // _ALIGN) * _ALIGN
            self._offset[name] = (size, shape)
            size += math.prod(shape)
        pin = self.device.type == "cuda"
        self._mirrors = [torch.zeros(size, dtype=torch.int32, pin_memory=pin)
                         for _ in range(_MIRRORS if self.staged else 1)]
        self._host = [{name: t[o:o + math.prod(shape)].numpy().reshape(shape)
                       for name, (o, shape) in self._offset.items()} for t in self._mirrors]
        for h in self._host:
            for name, value in (_INITIAL | {"seq_lens": q}).items():  # a padding row's q queries see q keys
                h[name][:] = value
        self._buf = torch.empty(size, **i32).copy_(self._mirrors[0]) if self.staged else self._mirrors[0]
        for name, (o, shape) in self._offset.items():
            setattr(self, name, self._buf[o:o + math.prod(shape)].view(shape))
        # One event per mirror, recorded after the copies that read it (CUDA only: elsewhere
        # the copies are synchronous).
        self._events = [torch.cuda.Event() for _ in self._mirrors] if pin and self.staged else None
        self._in_flight = [False] * len(self._mirrors)
        self._turn = 0
        # A table whose span would carry more unused ints than this goes compact (``_table``):
        # 256 KiB is ~5 us of PCIe, about what the device copy that places it costs.
        self.max_unused = 1 << 16
        self.last_copies: list[tuple[int, int]] = []  # the [lo, hi) spans the last load sent
        self.last_compact: list[str] = []  # the tables it sent compact
        self.query_start_loc = torch.arange(B + 1, **i32) * q  # never changes: not in the buffer
        self.num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                        if self.device.type == "cuda" else 132)
        self.attn_out = torch.zeros(B * q, model.num_heads, model.head_size, dtype=model.dtype, device=self.device)
        # Cascade needs the LSE of both passes, which ALiBi models cannot merge (no cascade there).
        self.cascade = model.config.use_alibi is False and q == 1
        self.pool = pool  # a graph memory pool to share (another DecodeGraphs'), else a new one
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        if capture:
            self._capture_all()

    def metadata(self, n: int, cascade: bool = False) -> FlashAttentionMetadata:
        """The step's metadata as views of the static buffers, padded to ``n`` rows."""
        q = self.query_len
        m = FlashAttentionMetadata(
            num_actual_tokens=n * q, max_query_len=q, query_start_loc=self.query_start_loc[:n + 1],
            max_seq_len=self.max_seq_len, seq_lens=self.seq_lens[:n],
            block_table=self.block_table[:n], slot_mapping=self.slot_mapping[:n * q],
            num_splits=decode_num_splits(n, self.model.num_kv_heads, self.num_sms),
            # Placeholders while capturing; at replay the buffers hold a plan the worker checked.
            host_checked=True)
        if self.chunk:
            m.local_attn_metadata = LocalAttentionMetadata(
                local_query_start_loc=m.query_start_loc, local_seqused_k=self.local_seqused_k[:n],
                local_block_table=self.local_block_table[:n], local_max_query_len=1,
                local_max_seq_len=self.chunk)
        if cascade:
            m.use_cascade, m.common_prefix_len, m.max_suffix_kv_len = True, self.max_seq_len, self.max_seq_len
            m.cu_prefix_query_lens, m.prefix_kv_lens = self.cu_prefix_query_lens, self.prefix_kv_lens
            m.prefix_block_table = self.prefix_block_table
            m.suffix_kv_lens, m.suffix_block_table = self.suffix_kv_lens[:n], self.suffix_block_table[:n]
        return m

    def _forward(self, n: int, cascade: bool) -> torch.Tensor:
        t = n * self.query_len
        return self.model(self.input_ids[:t], self.positions[:t], self.metadata(n, cascade),
                          attn_out=self.attn_out[:t])

    def _capture_all(self) -> None:
        # Largest first, all in one memory pool: smaller graphs reuse the larger ones' memory.
        pool = self.pool = self.pool if self.pool is not None else torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.inference_mode(), torch.cuda.stream(stream):
            for n in reversed(self.sizes):
                for cascade in (False, True) if self.cascade else (False,):
                    # One group holding every row: valid metadata for the warm-up run.
                    self.cu_prefix_query_lens.fill_(n)[0] = 0
                    self._forward(n, cascade)  # warm-up: Triton JIT, cuBLAS workspaces, lazy inits
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool, stream=stream):
                        self.outputs[n, cascade] = self._forward(n, cascade)
                    self.graphs[n, cascade] = g
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

    # -- per step -----------------------------------------------------------------------------
    def can_run(self, plan) -> bool:
        m = plan.attn
        b, width, q = m.num_reqs, self.block_table.shape[1], self.query_len
        loc = m.local_attn_metadata
        ok = (m.max_query_len == q
              and m.num_actual_tokens == b * q and 0 < b <= self.sizes[-1]
              and len(plan.input_token_ids) == b * q and m.max_seq_len <= self.max_seq_len
              and m.block_table.shape[1] <= width)
        if ok and q > 1:  # every row exactly q tokens (a row with fewer drafts: not this graph)
            ok = np.array_equal(np.asarray(m.query_start_loc), np.arange(b + 1) * q)
        if ok and loc is not None:  # decode: one virtual batch per row, one chunk's pages
            ok = (self.chunk is not None and len(loc.local_seqused_k) == b
                  and loc.local_block_table.shape[1] <= self.local_block_table.shape[1])
        if ok and m.use_cascade:
            ok = (self.cascade and len(m.prefix_kv_lens) <= MAX_CASCADE_GROUPS
                  and m.prefix_block_table.shape[1] <= width and m.suffix_block_table.shape[1] <= width)
        return ok

    def padded_size(self, b: int) -> int:
        return self.sizes[int(np.searchsorted(self.sizes, b))]

    def load(self, plan) -> int:
        """Write a decode step into the static buffers; returns the padded size to replay.

        The step goes into a host mirror with numpy, then over in one non-blocking copy per span
        touched (see the module docstring) -- not through the worker's per-array staging
        (``StepBuffers.put``): staging each array on its own is the cost this avoids."""
        m = plan.attn
        b, q = m.num_reqs, self.query_len
        n = self.padded_size(b)
        k, h = self._next_mirror()
        # Padding rows [b, n) write nowhere (slot -1) and read q tokens (seq_len q) for their q
        # queries; they are written every step because the span sent carries whatever the mirror
        # holds there.  Per-token inputs run to b * q (the real rows' tokens, in row order).
        _rows(h["input_ids"], b * q, n * q, plan.input_token_ids, 0)
        _rows(h["positions"], b * q, n * q, plan.positions, 0)
        _rows(h["slot_mapping"], b * q, n * q, m.slot_mapping[:b * q], -1)
        _rows(h["seq_lens"], b, n, m.seq_lens, q)
        if self.chunk:
            loc = m.local_attn_metadata
            if loc is None:  # every key in chunk 0: the rows themselves, from their first page
                pages = self.local_block_table.shape[1]
                loc = SimpleNamespace(local_seqused_k=m.seq_lens, local_block_table=m.block_table[:, :pages])
            _rows(h["local_seqused_k"], b, n, loc.local_seqused_k, 1)
            t = loc.local_block_table
            h["local_block_table"][:b, :t.shape[1]] = t  # padding rows keep ids of existing blocks
        compact: list[tuple[str, int, int, int]] = []
        # The per-row vectors, then the block table's rows [0, b) (or nothing more when compact).
        spans = [(0, self._table(h, "block_table", m.block_table, compact))]
        if m.use_cascade:
            G = len(m.prefix_kv_lens)
            cu, pk = h["cu_prefix_query_lens"], h["prefix_kv_lens"]
            cu[:G + 1] = m.cu_prefix_query_lens
            cu[G + 1:] = b  # padded groups: no queries, so the prefix pass skips them
            pk[:G] = m.prefix_kv_lens
            pk[G:] = 1
            _rows(h["suffix_kv_lens"], b, n, m.suffix_kv_lens, 1)
            spans += [(self._offset[name][0], self._table(h, name, a, compact))
                      for name, a in (("suffix_block_table", m.suffix_block_table),
                                      ("prefix_block_table", m.prefix_block_table))]
        if compact:
            spans.append((self._offset["_stage"][0], _top(compact)))
        self._send(k, spans)
        for name, r, c, lo in compact:
            # Stream-ordered after the copy that brought the stage area over.
            getattr(self, name)[:r, :c].copy_(self._buf[lo:lo + r * c].view(r, c))
        self.last_compact = [name for name, *_ in compact]
        return n

    def _table(self, h: dict[str, np.ndarray], name: str, a: np.ndarray, compact: list) -> int:
        """Write ``a`` [r, c] for the static table ``name``; returns where the table's span to
        send ends (its start: nothing, when ``a`` went compact).  Rows [0, r) to column c span
        (r - 1) * W + c ints; when more than ``max_unused`` and 3/4 of those are unused, ``a`` goes
        packed into the stage area instead and ``compact`` gets (name, r, c, its offset), for
        ``load`` to send and put in place.  3/4 bounds the stage area at 1/4 of the tables."""
        r, c = a.shape
        start = self._offset[name][0]
        span = (r - 1) * self._width + c if r > 0 and c > 0 else 0
        if span - r * c > self.max_unused and 4 * r * c <= span:
            lo = _top(compact) if compact else self._offset["_stage"][0]
            base = lo - self._offset["_stage"][0]
            h["_stage"][base:base + r * c] = a.reshape(-1)
            compact.append((name, r, c, lo))
            return start
        h[name][:r, :c] = a
        return start + span

    def _next_mirror(self) -> tuple[int, dict[str, np.ndarray]]:
        """The mirror to write this step, once its last copy has read it."""
        k = self._turn = (self._turn + 1) % len(self._mirrors)
        if self._in_flight[k]:
            self._events[k].synchronize()
            self._in_flight[k] = False
        return k, self._host[k]

    def _send(self, k: int, spans: list[tuple[int, int]]) -> None:
        spans = [(lo, hi) for lo, hi in spans if hi > lo]
        self.last_copies = spans
        if not self.staged:
            return  # the mirror is the buffer
        src = self._mirrors[k]
        for lo, hi in spans:
            self._buf[lo:hi].copy_(src[lo:hi], non_blocking=True)
        if self._events is not None:
            self._events[k].record(self._stream())
            self._in_flight[k] = True

    def _stream(self):
        return torch.cuda.current_stream(self.device)  # where copy_ queued the copies

    def replay(self, n: int, b: int, cascade: bool = False) -> torch.Tensor:
        """Final hidden states [b * query_len, hidden] of the step ``load`` staged (padded to ``n``)."""
        graph = self.graphs.get((n, cascade))
        t = b * self.query_len
        if graph is None:
            return self._forward(n, cascade)[:t]
        graph.replay()
        return self.outputs[n, cascade][:t]


def _top(compact: list[tuple[str, int, int, int]]) -> int:
    """End of the stage area's used part."""
    _, r, c, lo = compact[-1]
    return lo + r * c


def _rows(dst: np.ndarray, b: int, n: int, values, pad: int) -> None:
    """``values`` into rows [0, b) (cast to int32 as numpy copies), ``pad`` into rows [b, n)."""
    dst[:b] = values
    dst[b:n] = pad
