"""Decode steps through the CUDA-graph runner give what the eager path gives.

On CPU the runner's padded static-buffer path runs eagerly (``capture=False``): that is where the
padding logic lives, so the CPU tests check it; the GPU test adds the capture itself.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from ray_attn.engine import LLMEngine, SamplingParams
from ray_attn.planner import Planner, ScheduledRequest
from ray_attn.runtime import InProcessExecutor
from ray_attn.runtime.cuda_graphs import MAX_CASCADE_GROUPS, DecodeGraphs, batch_sizes
from ray_attn.runtime.worker import AttentionWorker


def config(device="cpu", dtype="float32", block_size=16, num_blocks=128, **model):
    m = dict(vocab_size=384, hidden_size=256, intermediate_size=384, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, seed=11, dtype=dtype,
             max_position_embeddings=1024)
    m.update(model)
    return EngineConfig(model=ModelConfig(**m), cache=CacheConfig(num_blocks=num_blocks, block_size=block_size),
                        parallel=ParallelConfig(device=device), max_num_batched_tokens=512, max_num_seqs=16,
                        # step-by-step logits comparisons: each step's output in its own step
                        async_scheduling=False)


class RecordingExecutor(InProcessExecutor):
    """Asks for the logits of every step, and counts the steps the graph runner served."""

    capture = False
    staged = None  # DecodeGraphs' default: host mirrors + copies on CUDA, none on CPU
    max_unused = None  # DecodeGraphs' default; 0 sends every table that allows it compact

    def __init__(self, config):
        capture, staged, max_unused = self.capture, self.staged, self.max_unused

        class Worker(AttentionWorker):
            def _capture_graphs(self):
                g = DecodeGraphs(self.model, 16, self.device, capture=capture, staged=staged)
                if max_unused is not None:
                    g.max_unused = max_unused
                return g

        self.worker_cls = Worker
        super().__init__(config)
        self.logits, self.graph_steps, self.cascade_graph_steps = [], 0, 0

    def step(self, step):
        step.return_logits = True
        g = self.worker.graphs
        served = bool(g is not None and g.can_run(step.plan))
        self.graph_steps += served
        self.cascade_graph_steps += served and step.plan.attn.use_cascade
        out = super().step(step)
        self.logits.append(out.logits)
        return out


class StagedExecutor(RecordingExecutor):
    """The GPU's staging on CPU: two host mirrors, and the spans copied into a separate buffer."""

    staged = True


class CompactExecutor(RecordingExecutor):
    """Tables sent compact and put in place by a device copy (on GPU: long-context models)."""

    max_unused = 0


class StagedCompactExecutor(StagedExecutor):
    max_unused = 0


GRAPH_EXECUTORS = [RecordingExecutor, StagedExecutor, CompactExecutor, StagedCompactExecutor]


class PlainExecutor(RecordingExecutor):
    def __init__(self, config):
        super().__init__(config)
        self.worker.graphs = None


def workload(vocab=384):
    # Different output lengths, so the decode batch shrinks 7 -> 1 and padded rows hold the
    # slots and lengths of requests that have finished.
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(5, 60, 7)]
    params = [SamplingParams(max_tokens=3 + 3 * i) for i in range(7)]
    return prompts, params


def shared_prefix_workload(vocab=384):
    # Two groups of five requests over 272-token prefixes (17 blocks; vLLM's rules want >= 256
    # tokens and >= 8 requests): decode steps run cascade with two prefix groups.
    rng = np.random.default_rng(9)
    prompts = []
    for _ in range(2):
        base = rng.integers(0, vocab, 272).tolist()
        prompts += [base + rng.integers(0, vocab, int(n)).tolist() for n in rng.integers(1, 12, 5)]
    return prompts, [SamplingParams(max_tokens=4 + i) for i in range(10)]


def run(executor_cls, cfg, work=workload, force_cascade=False):
    ex = executor_cls(cfg)
    eng = LLMEngine(cfg, ex)
    if force_cascade:
        eng.planner.cascade_min_saved_kv_tokens = 1  # cascade whenever a prefix is shared at all
    outs = eng.generate(*work())
    return [o.output_token_ids for o in outs], ex


def test_batch_sizes_cover_every_batch():
    sizes = batch_sizes(100)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 100
    assert all(b <= sizes[int(np.searchsorted(sizes, b))] <= b + 7 for b in range(1, 101))
    assert batch_sizes(1) == [1] and batch_sizes(3) == [1, 2, 3]


@pytest.mark.parametrize("executor", GRAPH_EXECUTORS)
def test_padded_decode_path_equals_eager_path(executor):
    cfg = config()
    ref_tokens, ref = run(PlainExecutor, cfg)
    tokens, ex = run(executor, cfg)
    assert ex.graph_steps >= 10 and ref.graph_steps == 0
    assert tokens == ref_tokens
    # float32 on both paths; only the padded rows differ, and rows never mix, so 1e-4 is loose.
    for a, b in zip(ex.logits, ref.logits):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("executor", GRAPH_EXECUTORS)
def test_padded_cascade_decode_equals_eager_path(executor):
    cfg = config()
    ref_tokens, ref = run(PlainExecutor, cfg, shared_prefix_workload, force_cascade=True)
    tokens, ex = run(executor, cfg, shared_prefix_workload, force_cascade=True)
    assert ex.cascade_graph_steps >= 3, "no cascade decode step went through the graph path"
    assert tokens == ref_tokens
    for a, b in zip(ex.logits, ref.logits):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


LOCAL = dict(layer_types=["chunked_attention", "full_attention", "chunked_attention"], attention_chunk_size=32)


@pytest.mark.parametrize("executor", GRAPH_EXECUTORS)
def test_padded_local_decode_equals_eager_path(executor):
    """Chunked-local layers (chunk 32: most rows span several chunks, some lie in chunk 0) read a
    decode step's virtual batches from the static buffers."""
    cfg = config(**LOCAL)
    ref_tokens, ref = run(PlainExecutor, cfg)
    tokens, ex = run(executor, cfg)
    assert ex.graph_steps >= 10
    assert tokens == ref_tokens
    for a, b in zip(ex.logits, ref.logits):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def decode_plan(executor, num_reqs: int):
    """An engine on ``executor`` past the prefill of ``num_reqs`` requests, and its next (decode)
    plan, planned but not run: (executor, its DecodeGraphs, the plan)."""
    cfg = config()
    ex = executor(cfg)
    eng = LLMEngine(cfg, ex)
    ids = [eng.add_request(p, SamplingParams(max_tokens=4)) for p in workload()[0][:num_reqs]]
    while not all(eng.requests[i].num_output_tokens for i in ids):
        eng.step()
    return ex, ex.worker.graphs, eng._plan()


@pytest.mark.parametrize("executor", [RecordingExecutor, StagedExecutor])
def test_padding_rows_write_nowhere(executor):
    ex, g, plan = decode_plan(executor, 3)
    assert g.can_run(plan) and plan.attn.num_reqs == 3
    poison(g)  # as if a larger step had left real slots, lengths and tokens behind
    n = g.load(plan)
    assert n == 4
    assert g.slot_mapping[3:4].tolist() == [-1] and g.seq_lens[3:4].tolist() == [1]
    assert g.input_ids[3:4].tolist() == [0] and g.positions[3:4].tolist() == [0]
    assert g.slot_mapping[:3].tolist() == plan.attn.slot_mapping[:3].tolist()
    assert g.seq_lens[:3].tolist() == plan.attn.seq_lens.tolist()


def test_prefill_and_oversized_steps_run_eagerly():
    cfg = config()
    ex = RecordingExecutor(cfg)
    eng = LLMEngine(cfg, ex)
    eng.add_request(list(range(20)), SamplingParams(max_tokens=2))
    plan = eng._plan()
    assert plan.attn.max_query_len > 1 and not ex.worker.graphs.can_run(plan)


def poison(g: DecodeGraphs) -> None:
    """Values no padding row may keep, in every static input on the device and in both host
    mirrors (when staged), as if earlier, larger steps had left them: real slots, long lengths,
    cascade groups with queries.  Block ids stay valid (1): only columns a row reads must be
    fresh, and those ``check_static_inputs`` checks."""
    values = {"input_ids": 9, "positions": 11, "slot_mapping": 7, "seq_lens": 5, "suffix_kv_lens": 5,
              "cu_prefix_query_lens": 3, "prefix_kv_lens": 5, "block_table": 1, "suffix_block_table": 1,
              "prefix_block_table": 1}
    for t in [g] + ([SimpleNamespace(**h) for h in g._host] if g.staged else []):
        for name, v in values.items():
            getattr(t, name)[:] = v


def check_static_inputs(g: DecodeGraphs, plan, n: int) -> None:
    """Every static input the graph for ``n`` reads holds this step's value: real rows from the
    plan, padding rows [b, n) with token 0, position 0, slot -1, seq_len 1 (and suffix_kv_len 1),
    padded cascade groups with no queries and prefix_kv_len 1.  Read back from the device."""
    m = plan.attn
    b, w = m.num_reqs, m.block_table.shape[1]

    def rows(name):
        return getattr(g, name)[:n].cpu().numpy()

    def padded(real, pad):
        return np.concatenate([np.asarray(real)[:b], np.full(n - b, pad)])

    np.testing.assert_array_equal(rows("input_ids"), padded(plan.input_token_ids, 0))
    np.testing.assert_array_equal(rows("positions"), padded(plan.positions, 0))
    np.testing.assert_array_equal(rows("slot_mapping"), padded(m.slot_mapping, -1))
    np.testing.assert_array_equal(rows("seq_lens"), padded(m.seq_lens, 1))
    np.testing.assert_array_equal(rows("block_table")[:b, :w], m.block_table)
    if m.use_cascade:
        G = len(m.prefix_kv_lens)
        wp, ws = m.prefix_block_table.shape[1], m.suffix_block_table.shape[1]
        cu = g.cu_prefix_query_lens.cpu().numpy()
        np.testing.assert_array_equal(
            cu, np.concatenate([m.cu_prefix_query_lens, np.full(MAX_CASCADE_GROUPS - G, b)]))
        np.testing.assert_array_equal(g.prefix_kv_lens.cpu().numpy(),
                                      np.concatenate([m.prefix_kv_lens, np.ones(MAX_CASCADE_GROUPS - G)]))
        np.testing.assert_array_equal(rows("suffix_kv_lens"), padded(m.suffix_kv_lens, 1))
        np.testing.assert_array_equal(g.prefix_block_table[:G, :wp].cpu().numpy(), m.prefix_block_table)
        np.testing.assert_array_equal(rows("suffix_block_table")[:b, :ws], m.suffix_block_table)


def _mixed_steps(ex, ref, check_static=True):
    """Planner-built steps fed to a graph-path worker ``ex`` and an eager worker ``ref`` with the
    same weights: a large decode step, a smaller and narrower one, a cascade one (fewer rows than
    the large step, so its padding rows held real slots), then a plain one over the requests whose
    KV a leaked padding row would have overwritten.  Returns (graph, eager) hidden states per
    decode step, the steps' plans, and the tables each step sent compact."""
    g = ex.worker.graphs
    p = Planner(num_blocks=ex.worker.num_blocks, block_size=ex.config.cache.block_size,
                num_query_heads=4, num_kv_heads=2, cascade_min_saved_kv_tokens=1,
                max_model_len=ex.config.model.max_position_embeddings)
    rng = np.random.default_rng(3)
    bs = ex.config.cache.block_size

    def request(name, n):
        return ScheduledRequest(name, rng.integers(0, 384, int(n)).tolist())

    longest = ex.config.model.max_position_embeddings - 64
    large = [request(f"L{i}", n) for i, n in enumerate(rng.integers(3 * bs, min(8 * bs, longest), 12))]
    small = [request(f"S{i}", n) for i, n in enumerate(rng.integers(3, min(bs - 2, 14), 3))]
    shared = []
    for grp in range(2):  # two prefix groups of 5 (the planner's cascade wants >= 8 requests)
        base = rng.integers(0, 384, 272).tolist()
        shared += [ScheduledRequest(f"C{grp}{j}", base + rng.integers(0, 384, int(k)).tolist())
                   for j, k in enumerate(rng.integers(1, 12, 5))]

    def eager(worker, plan):
        dm = plan.attn.to_device(worker.device)
        ids = torch.as_tensor(plan.input_token_ids, device=worker.device).long()
        pos = torch.as_tensor(plan.positions, device=worker.device).long()
        return worker.model(ids, pos, dm)

    # Prefill: each group's first request caches the shared prefix the others then hit.
    for batch in (large + small + shared[::5], [r for i, r in enumerate(shared) if i % 5]):
        plan = p.plan(batch)
        for worker in (ex.worker, ref.worker):
            eager(worker, plan)
    poison(g)
    out, plans, compacts = [], [], []
    for batch in (large, small, shared, large + small):
        for r in batch:
            r.token_ids.append(int(rng.integers(0, 384)))
            r.num_new_tokens = 1
        plan = p.plan(batch)
        m = plan.attn
        assert g.can_run(plan)
        n = g.load(plan)
        if check_static:
            check_static_inputs(g, plan, n)
        # One copy for a plain step, three for a cascade one; a compact table drops its own span
        # (the block table's: only the per-row vectors are left of the first) and the stage
        # area adds one.
        cascade_compact = [t for t in g.last_compact if t != "block_table"]
        assert len(g.last_copies) == (3 if m.use_cascade else 1) - len(cascade_compact) + bool(g.last_compact)
        out.append((g.replay(n, m.num_reqs, m.use_cascade).float().cpu(), eager(ref.worker, plan).float().cpu()))
        plans.append(plan)
        compacts.append(g.last_compact)
    widths = [pl.attn.block_table.shape[1] for pl in plans]
    assert [pl.attn.use_cascade for pl in plans] == [False, False, True, False]
    assert plans[1].attn.num_reqs < plans[2].attn.num_reqs < plans[0].attn.num_reqs
    assert widths[1] < widths[0], "the small step should leave stale columns from the large one"
    return out, plans, compacts


@pytest.mark.parametrize("max_positions", [1024, 4096])
@pytest.mark.parametrize("executor", GRAPH_EXECUTORS)
def test_stale_rows_never_leak_across_steps(executor, max_positions):
    """Large, small, cascade, then plain decode steps through one DecodeGraphs: every step equals
    the eager path run on its own cache, so no row, column or cascade group of an earlier step
    reached a later one (a stale slot in a padding row would overwrite a live request's KV)."""
    cfg = config(num_blocks=256, max_position_embeddings=max_positions)
    ex, ref = executor(cfg), PlainExecutor(cfg)
    out, plans, compacts = _mixed_steps(ex, ref)
    if executor.max_unused != 0:
        assert compacts == [[]] * 4
    elif max_positions == 1024:
        # 64-column tables: the cascade step's block table (18 columns: its rows hold the prefix
        # too) and prefix table (17) use more than 1/4 of their spans, so they go at full width.
        assert compacts == [["block_table"], ["block_table"], ["suffix_block_table"], ["block_table"]]
    else:  # 256 columns: the cascade step sends all three tables compact, one after another
        cascade = ["block_table", "suffix_block_table", "prefix_block_table"]
        assert compacts == [["block_table"], ["block_table"], cascade, ["block_table"]]
    for (got, want), plan in zip(out, plans):
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-4, rtol=1e-4,
                                   err_msg=f"step of {plan.attn.num_reqs} rows, cascade={plan.attn.use_cascade}")


@pytest.mark.parametrize("executor", [StagedExecutor, StagedCompactExecutor])
def test_staged_copies_cover_what_the_step_reads_and_no_more(executor):
    """Staged (the GPU's path, here on CPU): a plain step's one copy spans the per-row vectors
    and the block table's rows [0, b) up to column w.  Compact: the per-row vectors, then the
    table packed [b, w] in the stage area, put in place by a device copy.  (Cascade steps' copies
    are counted in ``_mixed_steps``.)"""
    ex, g, plan = decode_plan(executor, 5)
    assert g.can_run(plan) and not plan.attn.use_cascade
    b, w = plan.attn.num_reqs, plan.attn.block_table.shape[1]
    W = g.block_table.shape[1]
    assert w < W // 4, "the step should use a corner of the table"
    g._buf.fill_(-7)  # anything the copies do not reach stays -7 on the "device"
    n = g.load(plan)
    start = g._offset["block_table"][0]
    if executor.max_unused == 0:
        stage = g._offset["_stage"][0]
        assert g.last_compact == ["block_table"]
        assert g.last_copies == [(0, start), (stage, stage + b * w)]
        assert (g.block_table[:, w:] == -7).all()
    else:
        assert g.last_compact == []
        assert g.last_copies == [(0, start + (b - 1) * W + w)]
        # Rows [0, b - 1) go at full width (one span), the last row stops at column w.
        assert (g.block_table[:b - 1, w:] != -7).all() and (g.block_table[b - 1, w:] == -7).all()
        assert (g._stage == -7).all()
    assert (g.block_table[b:] == -7).all()
    assert (g.suffix_block_table == -7).all() and (g.prefix_block_table == -7).all()
    check_static_inputs(g, plan, n)


def test_staged_mirror_is_not_rewritten_before_its_copy_was_read():
    """Each host mirror's copies are followed by an event; the next ``load`` into that mirror
    waits on it first.  Fake events record the order (on CPU there is nothing to wait for)."""
    cfg = config()
    ex = StagedExecutor(cfg)
    g = ex.worker.graphs
    log = []

    class Event:
        def __init__(self, k):
            self.k = k

        def record(self, stream=None):
            log.append(("record", self.k, g._mirrors[self.k].clone()))

        def synchronize(self):
            # The mirror still holds what its last copy sent: nothing wrote it in between.
            sent = [e for e in log if e[0] == "record" and e[1] == self.k][-1][2]
            assert torch.equal(g._mirrors[self.k], sent)
            log.append(("sync", self.k, None))

    g._events = [Event(k) for k in range(len(g._mirrors))]
    g._stream = lambda: None
    eng = LLMEngine(cfg, ex)
    ids = [eng.add_request(p, SamplingParams(max_tokens=8)) for p in workload()[0][:4]]
    while not all(eng.requests[i].num_output_tokens for i in ids):
        eng.step()  # prefill (eager)
    before = ex.graph_steps
    for _ in range(3):
        eng.step()  # decode: the worker loads the step into the graphs' buffers
    assert ex.graph_steps == before + 3
    assert [(op, k) for op, k, _ in log] == [("record", 1), ("record", 0), ("sync", 1), ("record", 1)]


@pytest.mark.gpu
def test_captured_graphs_match_eager_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # bf16 (FlashAttention needs it); FA2 reads pages of 256, FA3 any size.
    from ray_attn.backend.kernels import _has_module

    block = 16 if _has_module("flash_attn_interface") else 256
    gpu = dict(device="cuda", dtype="bfloat16", block_size=block, hidden_size=512, num_attention_heads=8,
               num_key_value_heads=2)
    ex, ref = _captured_and_eager(config(**gpu))
    assert ex.worker.graphs.graphs, "nothing was captured"
    assert ex.graph_steps >= 10
    _check_close(ex, ref)
    # And cascade decode steps, replayed from their own graphs.
    ex, ref = _captured_and_eager(config(**gpu), shared_prefix_workload, force_cascade=True)
    assert ex.cascade_graph_steps >= 3
    _check_close(ex, ref)
    # And a model with chunked-local layers.
    ex, ref = _captured_and_eager(config(**gpu, **(LOCAL | dict(attention_chunk_size=block * 2))))
    assert ex.worker.graphs.graphs and ex.graph_steps >= 10
    _check_close(ex, ref)


def _captured_and_eager(cfg, work=workload, force_cascade=False):
    """The same run with decode graphs captured, and with no graph runner at all."""
    RecordingExecutor.capture = True
    try:
        _, ex = run(RecordingExecutor, cfg, work, force_cascade)
    finally:
        RecordingExecutor.capture = False
    return ex, run(PlainExecutor, cfg, work, force_cascade)[1]


def _check_close(ex, ref):
    # Graph and eager run the same kernels but GEMMs see padded batch sizes, which may pick other
    # tilings: bf16 rounding (~2^-8 relative) on logits of order 1 is what we allow, until the
    # first step where the greedy tokens part ways (a near tie may flip).
    compared = 0
    for a, b in zip(ex.logits, ref.logits):
        if a.shape != b.shape or (a.argmax(-1) != b.argmax(-1)).any():
            break
        np.testing.assert_allclose(a, b, atol=5e-2 * max(1.0, np.abs(b).max()), rtol=0)
        compared += 1
    assert compared >= 5


@pytest.mark.gpu
@pytest.mark.parametrize("executor", [RecordingExecutor, CompactExecutor])
def test_captured_graphs_mixed_steps_on_gpu(executor, monkeypatch):
    """The large/small/cascade/plain sequence with captured graphs: the static inputs read back
    from the device are exact (the staged spans, and the compact tables' device copies, carried
    every value the graphs read), and the replayed hidden states match the eager path to bf16
    rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from ray_attn.backend.kernels import _has_module

    block = 16 if _has_module("flash_attn_interface") else 256
    cfg = config(device="cuda", dtype="bfloat16", block_size=block, num_blocks=256,
                 hidden_size=512, num_attention_heads=8, num_key_value_heads=2)
    ref = PlainExecutor(cfg)  # before capture is switched on: PlainExecutor inherits it
    monkeypatch.setattr(executor, "capture", True)
    ex = executor(cfg)
    assert ex.worker.graphs.graphs and ex.worker.graphs.staged
    out, _, compacts = _mixed_steps(ex, ref)
    # FA3's 16-token pages leave the compact tables a corner of a 64-column table; FA2's 256-token
    # pages (4 columns) leave none.
    assert any(compacts) == (executor.max_unused == 0 and block == 16)
    for got, want in out:
        atol = 5e-2 * max(1.0, want.abs().max().item())  # bf16 rounding, as in _check_close
        np.testing.assert_allclose(got.numpy(), want.numpy(), atol=atol, rtol=0)


@pytest.mark.parametrize("mode", ["auto", "on"])
def test_failed_capture_falls_back_to_eager_unless_asked_for(mode):
    """A capture that fails (here: no CUDA behind a worker told it has one) leaves an eager
    worker with a warning under 'auto', and is an error under 'on'."""
    cfg = config()
    cfg = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"cuda_graphs": mode})})
    w = AttentionWorker(cfg)
    w.load_model()
    assert w.graphs is None and w.device_info()["cuda_graphs"] is False
    w.device, w.model.kernel_name = torch.device("cuda"), "fa3"  # as on a GPU rank
    if mode == "on":
        with pytest.raises((RuntimeError, AssertionError)):
            w._capture_graphs()
    else:
        with pytest.warns(UserWarning, match="CUDA graph capture failed"):
            assert w._capture_graphs() is None


def test_decode_graphs_split_kv_only_while_the_batch_leaves_sms_idle():
    from ray_attn.runtime.cuda_graphs import decode_num_splits

    assert decode_num_splits(16, 8, 132) == 0 and decode_num_splits(17, 8, 132) == 1
    assert decode_num_splits(256, 1, 132) == 1 and decode_num_splits(1, 8, 132) == 0
    ex = RecordingExecutor(config())
    g = ex.worker.graphs
    kv = ex.worker.model.num_kv_heads
    for n in g.sizes:
        assert g.metadata(n).num_splits == decode_num_splits(n, kv, g.num_sms)
    assert g.metadata(g.sizes[-1], cascade=True).num_splits == decode_num_splits(g.sizes[-1], kv, g.num_sms)
