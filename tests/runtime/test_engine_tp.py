"""The distributed engine gives the same tokens as a single process, for any TP and step path."""

from __future__ import annotations

import numpy as np
import pytest

from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from ray_attn.engine import LLMEngine, SamplingParams
from ray_attn.runtime import AttentionCluster, InProcessExecutor

pytestmark = pytest.mark.slow


def config(tp=1, compiled=False, num_blocks=96, **model):
    m = dict(vocab_size=384, hidden_size=256, intermediate_size=384, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, seed=7)
    m.update(model)
    return EngineConfig(model=ModelConfig(**m), cache=CacheConfig(num_blocks=num_blocks),
                        parallel=ParallelConfig(tensor_parallel_size=tp, device="cpu",
                                                use_compiled_graph=compiled, num_cpus_per_worker=1),
                        max_num_batched_tokens=256, max_num_seqs=16)


def workload(vocab=384, n=6):
    rng = np.random.default_rng(3)
    shared = rng.integers(0, vocab, 40).tolist()
    prompts = [shared + rng.integers(0, vocab, int(rng.integers(1, 30))).tolist() for _ in range(n)]
    prompts.append(rng.integers(0, vocab, 300).tolist())  # longer than the token budget: chunked prefill
    return prompts


GREEDY = SamplingParams(max_tokens=12)


@pytest.fixture(scope="module")
def single_process_tokens():
    cfg = config()
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    outs = eng.generate(workload(), GREEDY)
    toks = [o.output_token_ids for o in outs]
    # A model whose greedy output ignores its input would make every comparison below vacuous.
    assert len({tuple(t) for t in toks}) > 1 and all(len(set(t)) > 1 for t in toks), toks
    return toks


@pytest.mark.parametrize("tp,compiled", [(1, False), (2, False), (4, False), (2, True)])
def test_greedy_tokens_match_single_process(ray_local, single_process_tokens, tp, compiled):
    eng = LLMEngine(config(tp, compiled))
    try:
        outs = eng.generate(workload(), GREEDY)
        assert [o.output_token_ids for o in outs] == single_process_tokens
        assert eng.executor.compiled == compiled
    finally:
        eng.shutdown()


def test_one_object_ref_per_step_shared_by_all_ranks(ray_local):
    eng = LLMEngine(config(2))
    try:
        eng.generate(workload(n=3), SamplingParams(max_tokens=4))
        seen = eng.executor.call_all("refs_seen")
        assert eng.executor.num_puts == eng.stats.steps > 0
        assert seen[0] == seen[1], "every rank must read the same object"
        assert len(seen[0]) == len(set(seen[0])) == eng.stats.steps, "one new ref per step"
    finally:
        eng.shutdown()


def test_compiled_graph_equals_classic_logits(ray_local):
    """The two step paths run the same plan to the same logits, bit for bit."""
    from ray_attn.planner import ScheduledRequest
    from ray_attn.runtime import StepInput

    prompts = workload(n=3)
    results = []
    for compiled in (False, True):
        cfg = config(2, compiled)
        eng = LLMEngine(cfg)
        try:
            plan = eng.planner.plan([ScheduledRequest(f"r{i}", p) for i, p in enumerate(prompts)])
            B = plan.num_reqs
            out = eng.executor.step(StepInput(plan, np.zeros(B, np.float32), -np.ones(B, np.int64),
                                              np.zeros(B, np.int32), return_logits=True))
            results.append(out.logits)
        finally:
            eng.shutdown()
    assert np.array_equal(results[0], results[1])


def test_seeded_sampling_is_reproducible_across_tp(ray_local):
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=s) for s in range(3)]
    prompts = workload(n=3)[:3]
    cfg = config()
    single = LLMEngine(cfg, InProcessExecutor(cfg)).generate(prompts, params)
    eng = LLMEngine(config(2))
    try:
        dist = eng.generate(prompts, params)
    finally:
        eng.shutdown()
    assert [o.output_token_ids for o in dist] == [o.output_token_ids for o in single]
    assert len({tuple(o.output_token_ids) for o in single}) == 3


def test_seed_zero_is_a_seed():
    """Seed 0 must reach the rank as a seed (-1 there means none): two seed-0 copies of a prompt
    in one batch draw the same tokens, where unseeded copies draw different rows of the rank's
    generator."""
    cfg = config()
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=s) for s in (0, 0, 1, None, None)]
    outs = LLMEngine(cfg, InProcessExecutor(cfg)).generate([workload()[0]] * len(params), params)
    zero, zero_again, one, free, free_again = [o.output_token_ids for o in outs]
    assert zero == zero_again
    assert zero != one and zero != free
    assert free != free_again, "draws that ignore the generator would make the check above vacuous"


def test_preemption_by_recompute_keeps_tokens_and_frees_everything():
    """A cache far too small for the batch: requests are preempted and recomputed, none dropped."""
    prompts = workload(n=6)
    big = config(num_blocks=256)
    ref = LLMEngine(big, InProcessExecutor(big)).generate(prompts, GREEDY)
    small = config(num_blocks=30)
    eng = LLMEngine(small, InProcessExecutor(small))
    outs = eng.generate(prompts, GREEDY)
    assert eng.stats.preemptions > 0
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in ref]
    assert all(o.finish_reason == "length" for o in outs)
    assert eng.planner.stats()["num_used_blocks"] == 0
    assert not eng.requests and not eng.has_unfinished_requests(), "generate() releases its requests"


def test_preempted_request_is_readmitted_before_later_arrivals():
    """A preempted request goes back to the front of the queue: a request that arrived after it
    must not overtake it (under a steady stream of arrivals it would never run again)."""
    rng = np.random.default_rng(5)
    cfg = config(num_blocks=8)  # 128 tokens: A and B, or one of them and C, never all three
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    eng.add_request(rng.integers(0, 384, 30).tolist(), SamplingParams(max_tokens=60), "A")
    eng.add_request(rng.integers(0, 384, 30).tolist(), SamplingParams(max_tokens=60), "B")
    eng.step()
    eng.add_request(rng.integers(0, 384, 70).tolist(), SamplingParams(max_tokens=4), "C")
    entered, before = [], {"A", "B"}  # requests in the order they join the running batch
    while eng.has_unfinished_requests():
        eng.step()
        now = {r.request_id for r in eng.running}
        entered += sorted(now - before)
        before = now
    # The growing pair runs out of blocks and B, the newer, is preempted while C waits.
    assert eng.stats.preemptions == 1 and eng.requests["B"].num_preemptions == 1
    assert entered == ["B", "C"]
    assert all(eng.output(i).finish_reason == "length" for i in "ABC")


def test_prefix_cache_reuse_across_requests():
    cfg = config()
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    prompt = workload()[0]
    first = eng.generate([prompt], GREEDY)
    second = eng.generate([prompt], GREEDY)
    assert eng.planner.stats()["prefix_cache_hits"] >= 2 * cfg.cache.block_size
    assert first[0].output_token_ids == second[0].output_token_ids


def test_too_long_request_rejected_others_carry_on():
    cfg = config(num_blocks=20)
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    ok = eng.add_request(workload()[0], GREEDY)
    eng.step()  # the good request holds blocks when the bad ones arrive
    pool_before, queued_before = eng.planner.stats(), (len(eng.waiting), len(eng.running))
    with pytest.raises(ValueError, match="needs 2[0-9] KV blocks"):
        eng.add_request(list(range(330)), GREEDY)
    with pytest.raises(ValueError, match="exceeds the model's 8192-token context"):
        eng.add_request([1] * 8190, GREEDY)
    with pytest.raises(ValueError, match="token id 999"):
        eng.add_request([1, 999], GREEDY)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([], GREEDY)
    with pytest.raises(ValueError, match="max_tokens must be >= 1, got 0"):
        eng.add_request([1, 2], SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*63\)"):
        eng.add_request([1, 2], SamplingParams(seed=2 ** 63))  # an int64 on the ranks
    with pytest.raises(ValueError, match=f"request id {ok!r} is already in use"):
        eng.add_request([1, 2], GREEDY, request_id=ok)
    assert eng.planner.stats() == pool_before and (len(eng.waiting), len(eng.running)) == queued_before
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.output(ok).finish_reason == "length" and len(eng.output(ok).output_token_ids) == 12


@pytest.mark.parametrize("bad,match", [
    (dict(tp=3), "tensor_parallel_size=3 must divide"),
    (dict(hidden_size=320), "head size 80"),
])
def test_bad_model_config_fails_before_any_actor(monkeypatch, bad, match):
    """Validation happens while the config is built: no placement group, no actor."""
    def never(*a, **k):
        raise AssertionError("a cluster was started for an invalid config")

    monkeypatch.setattr("ray_attn.runtime.cluster.reserve_placement_group", never)
    with pytest.raises(ValueError, match=match):
        LLMEngine(config(**bad))


def test_admitting_more_than_the_cache_holds_backs_off_instead_of_failing():
    """Requests admitted in one attempt that overflows the cache go back to the queue (the
    planner never saw them); a second wave arrives while the first is decoding."""
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 384, 60).tolist() for _ in range(10)]
    big = config(num_blocks=256)
    ref = LLMEngine(big, InProcessExecutor(big)).generate(prompts, GREEDY)
    small = config(num_blocks=24)  # 384 tokens: about five of these requests at a time
    eng = LLMEngine(small, InProcessExecutor(small))
    ids = [eng.add_request(p, GREEDY) for p in prompts[:4]]
    eng.step()
    ids += [eng.add_request(p, GREEDY) for p in prompts[4:]]  # all admitted at once would overflow
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o.output_token_ids
    assert [done[i] for i in ids] == [o.output_token_ids for o in ref]


def test_calculate_kv_scales_come_from_the_first_step_and_stay():
    """vLLM's calculate_kv_scales through the engine: each layer's fp8 scales are set from the
    first batch (its absolute maxima over the scale constants), then fixed; without the option
    they stay at 1.0."""
    def run(calc):
        base = config()
        cfg = base.model_copy(update={"cache": CacheConfig(num_blocks=96, kv_cache_dtype="fp8",
                                                           calculate_kv_scales=calc)})
        eng = LLMEngine(cfg, InProcessExecutor(cfg))
        prompts = workload()
        eng.generate(prompts[:2], GREEDY)
        layers = [m.attn_layer for m in eng.executor.worker.model.modules() if hasattr(m, "attn_layer")]
        first = [(a._k_scale_float, a._v_scale_float, a._q_scale_float) for a in layers]
        eng.generate(prompts[2:], GREEDY)
        return layers, first, [(a._k_scale_float, a._v_scale_float, a._q_scale_float) for a in layers]

    layers, first, later = run(True)
    assert len(layers) == 3 and not any(a.calculate_kv_scales for a in layers)
    assert all(s != 1.0 and s > 0 for trio in first for s in trio)
    assert len(set(first)) == 3, "each layer has its own scales"
    assert later == first, "scales are fixed after the first batch"
    _, first, _ = run(False)
    assert all(s == 1.0 for trio in first for s in trio)
