"""Decode steps through the CUDA-graph runner give what the eager path gives.

On CPU the runner's padded static-buffer path runs eagerly (``capture=False``): that is where the
padding logic lives, so the CPU tests check it; the GPU test adds the capture itself.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from ray_attn.engine import LLMEngine, SamplingParams
from ray_attn.runtime import InProcessExecutor
from ray_attn.runtime.cuda_graphs import DecodeGraphs, batch_sizes
from ray_attn.runtime.worker import AttentionWorker


def config(device="cpu", dtype="float32", block_size=16, **model):
    m = dict(vocab_size=384, hidden_size=256, intermediate_size=384, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, seed=11, dtype=dtype,
             max_position_embeddings=1024)
    m.update(model)
    return EngineConfig(model=ModelConfig(**m), cache=CacheConfig(num_blocks=128, block_size=block_size),
                        parallel=ParallelConfig(device=device), max_num_batched_tokens=512, max_num_seqs=16)


class RecordingExecutor(InProcessExecutor):
    """Asks for the logits of every step, and counts the steps the graph runner served."""

    capture = False

    def __init__(self, config):
        capture = self.capture

        class Worker(AttentionWorker):
            def _capture_graphs(self):
                return DecodeGraphs(self.model, 16, self.device, capture=capture)

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


def test_padded_decode_path_equals_eager_path():
    cfg = config()
    ref_tokens, ref = run(PlainExecutor, cfg)
    tokens, ex = run(RecordingExecutor, cfg)
    assert ex.graph_steps >= 10 and ref.graph_steps == 0
    assert tokens == ref_tokens
    # float32 on both paths; only the padded rows differ, and rows never mix, so 1e-4 is loose.
    for a, b in zip(ex.logits, ref.logits):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_padded_cascade_decode_equals_eager_path():
    cfg = config()
    ref_tokens, ref = run(PlainExecutor, cfg, shared_prefix_workload, force_cascade=True)
    tokens, ex = run(RecordingExecutor, cfg, shared_prefix_workload, force_cascade=True)
    assert ex.cascade_graph_steps >= 3, "no cascade decode step went through the graph path"
    assert tokens == ref_tokens
    for a, b in zip(ex.logits, ref.logits):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_padding_rows_write_nowhere():
    cfg = config()
    ex = RecordingExecutor(cfg)
    g = ex.worker.graphs
    eng = LLMEngine(cfg, ex)
    ids = [eng.add_request(p, SamplingParams(max_tokens=4)) for p in workload()[0][:3]]
    while not all(eng.requests[i].num_output_tokens for i in ids):
        eng.step()
    plan = eng._plan()
    assert g.can_run(plan) and plan.attn.num_reqs == 3
    g.slot_mapping.fill_(7)  # as if a larger step had left real slots behind
    n = g.load(plan, ex.worker.buffers.put)
    assert n == 4
    assert g.slot_mapping[3:4].tolist() == [-1] and g.seq_lens[3:4].tolist() == [1]
    assert g.slot_mapping[:3].tolist() == plan.attn.slot_mapping[:3].tolist()


def test_prefill_and_oversized_steps_run_eagerly():
    cfg = config()
    ex = RecordingExecutor(cfg)
    eng = LLMEngine(cfg, ex)
    eng.add_request(list(range(20)), SamplingParams(max_tokens=2))
    plan = eng._plan()
    assert plan.attn.max_query_len > 1 and not ex.worker.graphs.can_run(plan)


@pytest.mark.gpu
def test_captured_graphs_match_eager_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    # bf16 (FlashAttention needs it); FA2 reads pages of 256, FA3 any size.
    from ray_attn.backend.kernels import _has_module

    block = 16 if _has_module("flash_attn_interface") else 256
    cfg = config(device="cuda", dtype="bfloat16", block_size=block,
                 hidden_size=512, num_attention_heads=8, num_key_value_heads=2)
    RecordingExecutor.capture = True
    try:
        _, ex = run(RecordingExecutor, cfg)
    finally:
        RecordingExecutor.capture = False
    _, ref = run(PlainExecutor, cfg)
    assert ex.worker.graphs.graphs, "nothing was captured"
    assert ex.graph_steps >= 10
    _check_close(ex, ref)
    # And cascade decode steps, replayed from their own graphs.
    RecordingExecutor.capture = True
    try:
        _, ex = run(RecordingExecutor, cfg, shared_prefix_workload, force_cascade=True)
    finally:
        RecordingExecutor.capture = False
    _, ref = run(PlainExecutor, cfg, shared_prefix_workload, force_cascade=True)
    assert ex.cascade_graph_steps >= 3
    _check_close(ex, ref)


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
