"""The Scheduler on its own, with a real planner and no ranks: a proposal changes nothing until
it is admitted, preemption and recovery put requests back at the front in the right order."""

from __future__ import annotations

from ray_attn.config import EngineConfig, ModelConfig
from ray_attn.planner import Planner
from ray_attn.request import Request, SamplingParams
from ray_attn.scheduler import Scheduler, SchedulerOutput

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
