"""The Scheduler on its own, with a real planner and no ranks: a proposal changes nothing until
it is admitted, preemption and recovery put requests back at the front in the right order, and
requests admitted together share the blocks the first computes.  Then the engine's ``n`` samples
of one prompt, against the same requests run one by one."""

from __future__ import annotations

import numpy as np
import pytest

from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from ray_attn.engine import LLMEngine
from ray_attn.planner import OutOfBlocksError, Planner, ScheduledRequest
from ray_attn.request import Request, SamplingParams
from ray_attn.runtime import InProcessExecutor, StepInput
from ray_attn.scheduler import Scheduler, SchedulerOutput
from tests.planner.helpers import KVOracle

BS = 16


def make(max_num_batched_tokens=64, max_num_seqs=8, num_blocks=64):
    model = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1)
    cfg = EngineConfig(model=model, max_num_batched_tokens=max_num_batched_tokens,
                       max_num_seqs=max_num_seqs)
    planner = Planner(num_blocks=num_blocks, block_size=BS, num_query_heads=2, num_kv_heads=1,
                      enable_cascade=False)
    return Scheduler(cfg, planner), planner


def req(i, n):
    return Request(f"r{i}", [i + 1] * n, n, SamplingParams(max_tokens=4))  # no shared prefixes


def plan(s: Scheduler, planner: Planner, out: SchedulerOutput):
    for r, n in zip(out.reqs, out.num_new_tokens):
        r.sched.num_new_tokens = n
    p = planner.plan([r.sched for r in out.reqs])
    s.admit(out.num_admitted)
    return p


def test_schedule_proposes_without_changing_the_queues():
    s, _ = make()
    a, b, c = req(0, 20), req(1, 30), req(2, 30)
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    # the budget (64) takes a and b whole and c's first 14 tokens
    assert [r.request_id for r in out.reqs] == ["r0", "r1", "r2"]
    assert out.num_new_tokens == [20, 30, 14] and out.num_admitted == 3
    assert list(s.waiting) == [a, b, c] and s.running == []
    assert s.schedule(admit=1).num_admitted == 1


def test_running_requests_come_first_then_the_queue():
    s, planner = make()
    a, b = req(0, 20), req(1, 20)
    s.add(a)
    plan(s, planner, s.schedule())
    a.token_ids.append(7)  # its first sampled token, read back
    s.add(b)
    out = s.schedule()
    assert out.reqs == [a, b] and out.num_new_tokens == [1, 20] and out.num_admitted == 1


def two_running_one_waiting():
    """a and b running (planned), c queued after them."""
    s, planner = make()
    a, b, c = req(0, 10), req(1, 10), req(2, 10)
    for r in (a, b):
        s.add(r)
    plan(s, planner, s.schedule())
    s.add(c)
    return s, planner, (a, b, c)


def test_preempt_one_frees_the_newest_and_puts_it_first_in_line():
    s, planner, (a, b, c) = two_running_one_waiting()
    assert s.preempt_one() is b
    assert s.running == [a] and list(s.waiting) == [b, c]
    assert not planner.has_request("r1") and b.num_preemptions == 1


def test_requeue_running_keeps_their_order_ahead_of_the_queue():
    s, planner, (a, b, c) = two_running_one_waiting()
    s.requeue_running()
    assert s.running == [] and list(s.waiting) == [a, b, c]
    assert not planner.has_request("r0") and not planner.has_request("r1")
    assert a.num_preemptions == 0  # a recovery is not a preemption


def test_remove_takes_a_request_off_either_queue():
    s, planner = make()
    a, b = req(0, 10), req(1, 10)
    s.add(a)
    plan(s, planner, s.schedule())
    s.add(b)
    s.remove(a)
    s.remove(b)
    assert not s.has_unfinished() and not planner.has_request("r0")


# --------------------------------------------------------------------------------- one step, n samples
def test_samples_admitted_together_count_each_others_blocks_and_free_budget():
    """Four samples of a 40-token prompt in a 64-token budget: the first computes it, the others
    take its two full blocks as hits and compute 8 tokens each, so all four fit in the step."""
    s, planner = make(max_num_batched_tokens=64)
    prompt = list(range(1, 41))
    reqs = [Request(f"s{i}", list(prompt), 40, SamplingParams(max_tokens=4)) for i in range(4)]
    for r in reqs:
        s.add(r)
    out = s.schedule()
    assert out.num_new_tokens == [40, 8, 8, 8] and out.num_admitted == 4
    p = plan(s, planner, out)  # the planner finds the hits the scheduler counted
    assert p.num_computed_tokens.tolist() == [0, 32, 32, 32]
    assert p.query_lens.tolist() == out.num_new_tokens and p.num_prefix_cache_hit_tokens == 96


def test_a_request_joining_a_running_chunk_counts_what_the_chunk_completes():
    s, planner = make(max_num_batched_tokens=64)
    prompt = list(range(1, 101))
    a, b = (Request(r, list(prompt), 100, SamplingParams(max_tokens=4)) for r in "ab")
    s.add(a)
    plan(s, planner, s.schedule())  # a's first 64 tokens: blocks 0-3, indexed
    s.add(b)
    out = s.schedule()
    # a computes 36 more (blocks 4 and 5 full, 6 not); b: 4 blocks cached + 2 from a's chunk
    assert out.reqs == [a, b] and out.num_new_tokens == [36, 4]
    p = plan(s, planner, out)
    assert p.num_computed_tokens.tolist() == [64, 96]


# --------------------------------------------------------------------------------- scheduler + planner
def drive(s: Scheduler, planner: Planner, oracle, rng, max_tokens) -> int:
    """One step as LLMEngine._plan takes it (fewer admissions, then preemption, on
    OutOfBlocksError), replayed through the cache oracle, then each sampling row's token.  Returns
    the hit tokens that blocks computed in the step itself gave."""
    admit = None
    while True:
        out = s.schedule(admit)
        if not out.reqs:
            return 0
        for r, n in zip(out.reqs, out.num_new_tokens):
            r.sched.num_new_tokens = n
        new = out.reqs[len(out.reqs) - out.num_admitted:]
        cached = sum(planner.num_cached_tokens(r.token_ids, n)
                     for r, n in zip(new, out.num_new_tokens[len(out.reqs) - out.num_admitted:]))
        try:
            p = planner.plan([r.sched for r in out.reqs])
        except OutOfBlocksError:
            if out.num_admitted > 1 or (out.num_admitted and s.running):
                admit = out.num_admitted - 1
                continue
            s.preempt_one()
            admit = 0
            continue
        s.admit(out.num_admitted)
        break
    oracle.step(p, {r.request_id: r.token_ids for r in out.reqs})
    assert p.req_ids == [r.request_id for r in out.reqs]  # no cascade: rows in order
    done = p.completes_prompt(np.array([len(r.token_ids) for r in out.reqs]))
    if sum(out.num_new_tokens) < s.max_num_batched_tokens:
        # budget left: the planner found every hit the scheduler counted, or a request admitted
        # would be left short of its prompt
        assert done.all()
    for r, d in zip(out.reqs, done.tolist()):
        if d:
            r.token_ids.append(int(rng.integers(1, 128)))
            if len(r.token_ids) - r.num_prompt_tokens >= max_tokens:
                s.remove(r)
    return p.num_prefix_cache_hit_tokens - cached


@pytest.mark.parametrize("seed", range(6))
def test_random_arrivals_of_samples_with_preemption_and_aborts(seed):
    """Groups of samples of a few prompts arrive over time into a small cache: chunked prefill,
    in-step hits, preemption and aborts; every step's reads checked against the cache oracle, the
    pool's books against the requests holding blocks."""
    rng = np.random.default_rng(seed)
    budget = int(rng.choice([32, 64, 256]))
    s, planner = make(max_num_batched_tokens=budget, max_num_seqs=8, num_blocks=int(rng.integers(10, 30)))
    oracle = KVOracle(BS)
    prompts = [rng.integers(1, 128, int(rng.integers(1, 120))).tolist() for _ in range(3)]
    nxt, max_tokens, in_step = 0, 6, 0
    for step in range(80):
        if rng.random() < 0.3 or not s.has_unfinished():
            base = prompts[int(rng.integers(len(prompts)))]
            for _ in range(int(rng.integers(1, 5))):
                tokens = list(base) + rng.integers(1, 128, int(rng.integers(0, 3))).tolist()
                s.add(Request(f"q{nxt}", tokens, len(tokens), SamplingParams(max_tokens=max_tokens)))
                nxt += 1
        in_step += drive(s, planner, oracle, rng, max_tokens)
        if s.running and rng.random() < 0.1:  # an abort, mid-prefill or mid-decode
            s.remove(s.running[int(rng.integers(len(s.running)))])
        planner.pool.check_invariants()
        held = np.zeros(planner.pool.num_blocks, dtype=np.int64)
        for r in s.running:
            np.add.at(held, planner.block_ids(r.request_id), 1)
        assert np.array_equal(held, planner.pool.ref_cnt)
    assert in_step > 0


# --------------------------------------------------------------------------------- the engine, n samples
def engine_config(budget=2048, tp=1, num_blocks=256):
    return EngineConfig(model=ModelConfig.from_name("tiny"), cache=CacheConfig(num_blocks=num_blocks, block_size=BS),
                        parallel=ParallelConfig(device="cpu", tensor_parallel_size=tp, num_cpus_per_worker=1),
                        cascade_min_saved_kv_tokens=0, max_num_batched_tokens=budget)


def engine(**kw):
    cfg = engine_config(**kw)
    return LLMEngine(cfg, InProcessExecutor(cfg))


def one_by_one(prompt, params, **kw):
    """Each request alone in a fresh engine: nothing shared, nothing batched."""
    return [engine(**kw).generate([prompt], [sp])[0].output_token_ids for sp in params]


def sampling(kind, n, max_tokens=8):
    return [SamplingParams(max_tokens=max_tokens, temperature=0.0 if kind == "greedy" else 1.0, seed=i)
            for i in range(n)]


def test_n_samples_compute_the_prompt_once():
    """The issue's example: 4 seeded samples of a 99-token prompt compute it once, then 3 tokens
    each (the last block is partial: 96 tokens are hits)."""
    e = engine()
    prompt = list(range(1, 100))
    e.generate([prompt] * 4, sampling("seeded", 4))
    decode = 4 * 7
    assert e.stats.tokens_computed == 99 + 3 * 3 + decode
    assert e.stats.prefix_cache_hit_tokens == e.planner.stats()["prefix_cache_hits"] == 3 * 96
    # Four requests stay below vLLM's MIN_NUM_REQS (8) and a 96-token prefix below its 256 tokens:
    # the cascade gates refuse, however much is shared.
    assert e.stats.cascade_steps == 0


def test_eight_samples_of_a_long_prompt_cascade_every_decode_step():
    e = engine()
    prompt = list(range(1, 301))
    plans = []
    plan = e.planner.plan
    e.planner.plan = lambda sched: plans.append(plan(sched)) or plans[-1]
    e.generate([prompt] * 8, sampling("seeded", 8, max_tokens=4))
    assert [p.query_lens.tolist() for p in plans] == [[300] + [12] * 7] + [[1] * 8] * 3
    assert e.stats.tokens_computed == 300 + 7 * 12 + 8 * 3
    assert e.stats.cascade_steps == 3 and e.stats.multi_group_cascade_steps == 0
    assert all(p.num_cascade_groups == 1 for p in plans[1:])


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
@pytest.mark.parametrize("length", [99, 96])
def test_shared_samples_give_the_tokens_of_requests_run_one_by_one(kind, length):
    rng = np.random.default_rng(length)
    prompt = rng.integers(0, 512, length).tolist()
    params = sampling(kind, 4)
    e = engine()
    shared = [o.output_token_ids for o in e.generate([prompt] * 4, params)]
    hit = (length - 1) // BS * BS
    assert e.stats.tokens_computed == length + 3 * (length - hit) + 4 * 7
    assert shared == one_by_one(prompt, params)
    if kind == "seeded":
        assert len({tuple(t) for t in shared}) == 4, "equal draws would make the check vacuous"


def test_sharers_read_the_kv_the_first_sample_writes_in_the_same_step():
    """Logits of the step that computes the prompt once: each sharer's last-token logits equal,
    to float32 rounding (the batch differs), those of the prompt computed alone."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 512, 99).tolist()

    def logits(e, scheduled):
        p = e.planner.plan(scheduled)
        B = p.num_reqs
        out = e.executor.step(StepInput(p, np.zeros(B, np.float32), -np.ones(B, np.int64),
                                        np.zeros(B, np.int32), return_logits=True))
        return p, out.logits

    p, shared = logits(engine(), [ScheduledRequest(f"s{i}", prompt) for i in range(4)])
    assert p.query_lens.tolist() == [99, 3, 3, 3]
    _, alone = logits(engine(), [ScheduledRequest("a", prompt)])
    assert np.abs(shared - alone[0]).max() <= 1e-5 * np.abs(alone).max()


def test_chunked_prompt_longer_than_the_budget_shared_by_three():
    """300 tokens, 128 a step: the first request prefills in three chunks; the other two join in
    the last one, taking the 18 blocks full after it, and compute 12 tokens each."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 512, 300).tolist()
    params = sampling("seeded", 3, max_tokens=6)
    e = engine(budget=128)
    outs = [o.output_token_ids for o in e.generate([prompt] * 3, params)]
    assert e.stats.tokens_computed == 300 + 2 * 12 + 3 * 5
    assert e.stats.prefix_cache_hit_tokens == 2 * 288
    assert outs == one_by_one(prompt, params, budget=128)


def test_abort_a_sharer_mid_prefill_and_preempt_sharers():
    """b shares a's first 4 blocks in the step a computes them and stops mid-prefill (budget);
    it is aborted there.  Then 2 x 4 samples into a cache too small for them: preemption by
    recompute.  Tokens as if alone; every block back at the end."""
    rng = np.random.default_rng(2)
    system = rng.integers(0, 512, 64).tolist()
    a, b = (system + rng.integers(0, 512, 100).tolist() for _ in "ab")
    e = engine(budget=200)
    ia = e.add_request(a, SamplingParams(max_tokens=6))
    ib = e.add_request(b, SamplingParams(max_tokens=6))
    e.step()
    assert e.planner.num_computed_tokens(ib) == 64 + 36  # 64 hit + the 36 the budget left
    assert e.stats.prefix_cache_hit_tokens == 64
    e.abort_request(ib)
    while e.has_unfinished_requests():
        e.step()
    assert e.output(ia).output_token_ids == one_by_one(a, [SamplingParams(max_tokens=6)])[0]
    assert e.planner.stats()["num_used_blocks"] == 0

    prompts = [rng.integers(0, 512, 94).tolist() for _ in range(2)]
    params = sampling("seeded", 4)
    small = engine(num_blocks=12)  # 4 samples: 5 shared blocks + 4 own, then 4 more to decode
    outs = small.generate([prompts[0]] * 4 + [prompts[1]] * 4, params * 2)
    assert small.stats.preemptions > 0 and small.stats.prefix_cache_hit_tokens > 0
    ref = engine().generate([prompts[0]] * 4 + [prompts[1]] * 4, params * 2)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in ref]
    assert small.planner.stats()["num_used_blocks"] == 0
    small.planner.pool.check_invariants()


@pytest.mark.slow
def test_n_samples_over_a_tp2_cluster(ray_local):
    """Two CPU ranks each read the shared blocks of their own heads: the same tokens as in-process
    requests run one by one."""
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, 512, 99).tolist()
    e = LLMEngine(engine_config(tp=2))
    try:
        greedy, seeded = sampling("greedy", 4), sampling("seeded", 4)
        outs = [[o.output_token_ids for o in e.generate([prompt] * 4, sp)] for sp in (greedy, seeded)]
        assert e.stats.prefix_cache_hit_tokens == 3 * 96 + 4 * 96  # the second call hits the first's
    finally:
        e.shutdown()
    assert outs == [one_by_one(prompt, greedy), one_by_one(prompt, seeded)]
