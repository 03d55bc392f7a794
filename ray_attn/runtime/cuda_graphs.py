"""Pure-decode steps replayed from CUDA graphs: one graph per padded batch size.

A Llama-3-8B decode step launches ~1,300 small kernels; from Python that takes 20-30 ms of host
time while the GPU needs 4-12 ms, so eager decode is bound by launches.  A captured graph
replays the whole forward with one launch.  A graph bakes in its tensors' addresses and its
host-side arguments, so every input lives in a static buffer here, padded to the batch size the
graph was captured for, and the host arguments are fixed upper bounds:

- ``max_query_len`` is 1 and ``query_start_loc`` is ``arange``: only pure decode steps qualify;
  prefill and chunked-local steps run eagerly (their shapes vary step to step).
- ``max_seq_len`` is the model's ``max_position_embeddings``.  The kernels bound each row by
  ``seq_lens`` (FA3 sizes its KV splits on the device from them), so the bound costs nothing.
- Padding rows write nowhere (slot -1) and attend over one token of an existing block; their
  outputs are dropped.  Rows are independent through every layer, so padding never changes a
  real row.
- Cascade decode steps get graphs of their own, with the prefix groups padded to
  ``MAX_CASCADE_GROUPS``: a padded group has no queries, so the prefix pass skips it.  Without
  them a cascade step would run eagerly, bound by launches, and lose to the plain step it was
  meant to beat.

On CPU the same padded path runs eagerly (``capture=False``), which is how the tests check the
padding logic without a GPU.
"""

from __future__ import annotations

import numpy as np
import torch

from ray_attn.metadata import FlashAttentionMetadata

MAX_CASCADE_GROUPS = 32


def wants_cuda_graphs(parallel, kernel: str) -> bool:
    """Whether a rank captures decode graphs (given a GPU): the flash kernels only, since the torch
    reference kernel reads lengths on the host; under 'auto' at TP=1 only."""
    mode = parallel.cuda_graphs
    return kernel in ("fa3", "fa2") and (mode == "on" or (mode == "auto" and parallel.tensor_parallel_size == 1))


def batch_sizes(max_batch: int) -> list[int]:
    """The padded sizes we capture: fine steps where padding would waste most (vLLM's scheme)."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch, 8))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    def __init__(self, model, max_batch: int, device: torch.device, capture: bool = True):
        if max_batch < 1:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        self.model, self.device = model, torch.device(device)
        self.sizes = batch_sizes(max_batch)
        B = self.sizes[-1]
        self.max_seq_len = model.config.max_position_embeddings
        width = -(-self.max_seq_len // model.block_size)
        i32 = dict(dtype=torch.int32, device=self.device)
        self.input_ids = torch.zeros(B, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(B, dtype=torch.long, device=self.device)
        self.slot_mapping = torch.full((B,), -1, **i32)
        self.seq_lens = torch.ones(B, **i32)
        self.query_start_loc = torch.arange(B + 1, **i32)
        self.block_table = torch.zeros(B, width, **i32)
        G = MAX_CASCADE_GROUPS
        self.cu_prefix_query_lens = torch.zeros(G + 1, **i32)
        self.prefix_kv_lens = torch.ones(G, **i32)
        self.prefix_block_table = torch.zeros(G, width, **i32)
        self.suffix_kv_lens = torch.ones(B, **i32)
        self.suffix_block_table = torch.zeros(B, width, **i32)
        self.attn_out = torch.zeros(B, model.num_heads, model.head_size, dtype=model.dtype, device=self.device)
        # Cascade needs the LSE of both passes, which ALiBi models cannot merge (no cascade there).
        self.cascade = model.config.use_alibi is False
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        if capture:
            self._capture_all()

    def metadata(self, n: int, cascade: bool = False) -> FlashAttentionMetadata:
        """The step's metadata as views of the static buffers, padded to ``n`` rows."""
        m = FlashAttentionMetadata(
            num_actual_tokens=n, max_query_len=1, query_start_loc=self.query_start_loc[:n + 1],
            max_seq_len=self.max_seq_len, seq_lens=self.seq_lens[:n],
            block_table=self.block_table[:n], slot_mapping=self.slot_mapping[:n])
        if cascade:
            m.use_cascade, m.common_prefix_len, m.max_suffix_kv_len = True, self.max_seq_len, self.max_seq_len
            m.cu_prefix_query_lens, m.prefix_kv_lens = self.cu_prefix_query_lens, self.prefix_kv_lens
            m.prefix_block_table = self.prefix_block_table
            m.suffix_kv_lens, m.suffix_block_table = self.suffix_kv_lens[:n], self.suffix_block_table[:n]
        return m

    def _forward(self, n: int, cascade: bool) -> torch.Tensor:
        return self.model(self.input_ids[:n], self.positions[:n], self.metadata(n, cascade),
                          attn_out=self.attn_out[:n])

    def _capture_all(self) -> None:
        # Largest first, all in one memory pool: smaller graphs reuse the larger ones' memory.
        pool = torch.cuda.graph_pool_handle()
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
        b, width = m.num_reqs, self.block_table.shape[1]
        ok = (m.local_attn_metadata is None and m.max_query_len == 1
              and m.num_actual_tokens == b and 0 < b <= self.sizes[-1]
              and len(plan.input_token_ids) == b and m.max_seq_len <= self.max_seq_len
              and m.block_table.shape[1] <= width)
        if ok and m.use_cascade:
            ok = (self.cascade and len(m.prefix_kv_lens) <= MAX_CASCADE_GROUPS
                  and m.prefix_block_table.shape[1] <= width and m.suffix_block_table.shape[1] <= width)
        return ok

    def padded_size(self, b: int) -> int:
        return self.sizes[int(np.searchsorted(self.sizes, b))]

    def load(self, plan, put) -> int:
        """Copy a decode step into the static buffers; returns the padded size to replay.
        ``put(name, array)`` stages a numpy array on the device (``StepBuffers.put``)."""
        m = plan.attn
        b, w = m.num_reqs, m.block_table.shape[1]
        n = self.padded_size(b)
        self.input_ids[:b].copy_(put("input_token_ids", plan.input_token_ids))
        self.positions[:b].copy_(put("positions", plan.positions))
        self.slot_mapping[:b].copy_(put("slot_mapping", m.slot_mapping[:b]))
        self.seq_lens[:b].copy_(put("seq_lens", m.seq_lens))
        self.block_table[:b, :w].copy_(put("block_table", m.block_table))
        if n > b:
            # A previous, larger step left real slots and lengths in these rows.
            self.slot_mapping[b:n].fill_(-1)
            self.seq_lens[b:n].fill_(1)
            self.suffix_kv_lens[b:n].fill_(1)
        if m.use_cascade:
            G = len(m.prefix_kv_lens)
            self.cu_prefix_query_lens[:G + 1].copy_(put("cu_prefix_query_lens", m.cu_prefix_query_lens))
            self.cu_prefix_query_lens[G + 1:].fill_(b)  # padded groups: no queries
            self.prefix_kv_lens[:G].copy_(put("prefix_kv_lens", m.prefix_kv_lens))
            self.prefix_kv_lens[G:].fill_(1)
            wp, ws = m.prefix_block_table.shape[1], m.suffix_block_table.shape[1]
            self.prefix_block_table[:G, :wp].copy_(put("prefix_block_table", m.prefix_block_table))
            self.suffix_kv_lens[:b].copy_(put("suffix_kv_lens", m.suffix_kv_lens))
            self.suffix_block_table[:b, :ws].copy_(put("suffix_block_table", m.suffix_block_table))
        return n

    def replay(self, n: int, b: int, cascade: bool = False) -> torch.Tensor:
        """Final hidden states [b, hidden] of the step ``load`` staged (padded to ``n``)."""
        graph = self.graphs.get((n, cascade))
        if graph is None:
            return self._forward(n, cascade)[:b]
        graph.replay()
        return self.outputs[n, cascade][:b]
