"""Verifying steps through the decode-graph runner (``DecodeGraphs(query_len=1 + k)``) give what
the eager path gives.  On CPU the padded static-buffer path runs eagerly (``capture=False``), as
in tests/runtime/test_cuda_graphs.py; the GPU test adds the capture.

A proposer that knows the plain greedy continuation proposes k tokens every step (the last one
wrong every other step), so most steps are uniform 1 + k queries the graphs serve, with accepted
and rejected drafts; rows near their max_tokens get fewer drafts, and those steps run eagerly.
Tokens must be equal; logits (float32 on both paths, rows never mixed) within 1e-4."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from ray_attn.engine import LLMEngine, SamplingParams
from ray_attn.runtime import InProcessExecutor
from ray_attn.runtime.cuda_graphs import DecodeGraphs
from ray_attn.runtime.worker import AttentionWorker

K = 3
MODEL = dict(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, seed=7, max_position_embeddings=512)


def config(device="cpu", dtype="float32", spec=True) -> EngineConfig:
    # on a GPU head size 64 (FlashAttention 3's; the flash kernels are the ones with graphs)
    model = MODEL | (dict(hidden_size=256, intermediate_size=512) if device == "cuda" else {})
    return EngineConfig(model=ModelConfig(**model, dtype=dtype), cache=CacheConfig(num_blocks=96),
                        parallel=ParallelConfig(device=device), max_num_batched_tokens=256, max_num_seqs=8,
                        async_scheduling=False, speculative_config=dict(
                            method="ngram", num_speculative_tokens=K, disable_by_batch_size=None) if spec else None)


class GraphExecutor(InProcessExecutor):
    """CPU: the padded paths of both graph sets, eagerly; counts the steps each served."""

    graphs, staged = True, None

    def __init__(self, cfg):
        graphs, staged = self.graphs, self.staged

        class Worker(AttentionWorker):
            def _capture_graphs(self):
                if not graphs:
                    return None
                g = DecodeGraphs(self.model, 8, self.device, capture=False, staged=staged)
                self.spec_graphs = DecodeGraphs(self.model, 8, self.device, capture=False, staged=staged,
                                                query_len=1 + K)
                return g

        self.worker_cls = Worker
        super().__init__(cfg)
        self.logits, self.spec_graph_steps = [], 0

    def step(self, step):
        step.return_logits = True
        sg = self.worker.spec_graphs
        self.spec_graph_steps += bool(sg is not None and sg.can_run(step.plan))
        out = super().step(step)
        self.logits.append(out.logits)
        return out


class StagedExecutor(GraphExecutor):
    staged = True


class EagerExecutor(GraphExecutor):
    graphs = False


class Oracle:
    """Drafts from the plain greedy outputs: the next K tokens, the last one off every other call."""

    def __init__(self, prompts, outputs):
        self.runs = [(p, o) for p, o in zip(prompts, outputs)]
        self.calls = 0

    def propose(self, tokens, k=None):
        self.calls += 1
        t = tokens.tolist()
        for p, o in self.runs:
            if t[:len(p)] == p:
                done = len(t) - len(p)
                d = list(o[done:done + min(K, k or K)])
                if d and self.calls % 2:
                    d[-1] = (d[-1] + 1) % MODEL["vocab_size"]
                return np.asarray(d, dtype=tokens.dtype)
        return tokens[:0]


def workload():
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 384, int(n)).tolist() for n in (9, 30, 17, 44, 23)]
    return prompts, [SamplingParams(max_tokens=n) for n in (40, 40, 13, 40, 40)]  # one ends early: non-uniform steps


def run(executor_cls, cfg, oracle):
    ex = executor_cls(cfg)
    eng = LLMEngine(cfg, ex)
    if eng.spec is not None:
        eng.spec.proposer = oracle
    outs = eng.generate(*workload())
    return [o.output_token_ids for o in outs], ex, eng


@pytest.fixture(scope="module")
def plain():
    prompts, _ = workload()
    toks, _, _ = run(EagerExecutor, config(spec=False), None)
    return prompts, toks


@pytest.mark.parametrize("executor", [GraphExecutor, StagedExecutor])
def test_uniform_verifying_steps_through_the_graph_path_equal_eager(plain, executor):
    prompts, want = plain
    ref_toks, ref, ref_eng = run(EagerExecutor, config(), Oracle(prompts, want))
    toks, ex, eng = run(executor, config(), Oracle(prompts, want))
    assert toks == ref_toks == want  # speculative greedy is plain greedy
    s = eng.spec.stats
    assert s.num_accepted_tokens > 0 and s.num_accepted_tokens < s.num_draft_tokens  # both kinds ran
    assert ex.spec_graph_steps >= 5 and ref.spec_graph_steps == 0
    assert len(ex.logits) == len(ref.logits) > ex.spec_graph_steps  # some steps ran eagerly (fewer drafts)
    for a, b in zip(ex.logits, ref.logits):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_only_uniform_full_length_steps_qualify():
    cfg = config()
    ex = GraphExecutor(cfg)
    sg = ex.worker.spec_graphs
    plan = lambda qsl: type("P", (), dict(attn=type("M", (), dict(  # noqa: E731
        num_reqs=len(qsl) - 1, max_query_len=int(np.diff(qsl).max()), num_actual_tokens=qsl[-1],
        query_start_loc=np.asarray(qsl), max_seq_len=64, block_table=np.zeros((len(qsl) - 1, 4), np.int32),
        local_attn_metadata=None, use_cascade=False)), input_token_ids=np.zeros(qsl[-1], np.int32)))
    assert sg.can_run(plan([0, 4, 8, 12]))
    assert not sg.can_run(plan([0, 4, 6, 10]))  # a row with one draft: max_query_len still 4
    assert not sg.can_run(plan([0, 1, 2]))  # plain decode: the other graphs' step
    assert not ex.worker.graphs.can_run(plan([0, 4, 8]))


def plain_tokens(cfg, prompts, params) -> list[list[int]]:
    """The greedy tokens of a plain engine of ``cfg``, run in this process and shut down after: an
    engine left alive holds its GPU (its Ray placement group or its worker), and the next GPU test
    of the process could not start (one did: "could not reserve 1 bundles of {'GPU': 1}")."""
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    try:
        return [o.output_token_ids for o in eng.generate(prompts, params)]
    finally:
        eng.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_captured_verifying_graphs_match_eager_on_gpu():
    """bf16, FlashAttention through real captures (the worker's own _capture_graphs)."""
    prompts, _ = workload()
    cfg = config("cuda", "bfloat16")
    plain_toks = plain_tokens(config("cuda", "bfloat16", spec=False), *workload())
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    assert eng.executor.worker.spec_graphs is not None, eng.executor.infos[0]["kernel"]
    replays = []
    g = eng.executor.worker.spec_graphs
    orig = g.replay
    g.replay = lambda *a: replays.append(a) or orig(*a)
    eng.spec.proposer = Oracle(prompts, plain_toks)
    toks = [o.output_token_ids for o in eng.generate(*workload())]
    assert len(replays) >= 5
    assert toks == plain_toks
