"""What the engine does with adapters besides computing them: refusing bad ones by name (and
going on with the others), keying the prefix cache by adapter, the host LRU in front of the disk,
and unloading only what no request uses."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from ray_attn.engine import LLMEngine, SamplingParams
from ray_attn.lora import LoRAAdapterError, LoRARequest
from ray_attn.planner import Planner, ScheduledRequest
from ray_attn.runtime import InProcessExecutor
from tests.lora.peft_fixture import engine_config, prompts, tiny_model, write_adapter, write_base

GREEDY = SamplingParams(max_tokens=3)


@pytest.fixture(scope="module")
def engine(lora_models):
    base, _ = lora_models
    cfg = engine_config(base, max_loras=1, max_lora_rank=8, max_cpu_loras=2)
    return LLMEngine(cfg, InProcessExecutor(cfg))


def bad_copy(src, dst, edit):
    shutil.copytree(src, dst)
    edit(str(dst))
    return str(dst)


def corrupt(folder):
    with open(os.path.join(folder, "adapter_model.safetensors"), "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")


def dora(folder):
    p = os.path.join(folder, "adapter_config.json")
    cfg = json.load(open(p))
    json.dump(cfg | {"use_dora": True}, open(p, "w"))


def test_bad_adapters_are_refused_by_name_and_nothing_else_is_disturbed(engine, lora_models, tmp_path):
    base, adapters = lora_models
    other_base = write_base(tmp_path / "other", tiny_model(hidden_size=96, num_attention_heads=3,
                                                           num_key_value_heads=1))
    cases = {
        "over max_lora_rank=8": adapters["all"],  # rank 16
        "is not a folder": str(tmp_path / "nowhere"),
        "not a readable safetensors file": bad_copy(adapters["qv"], tmp_path / "corrupt", corrupt),
        "DoRA is not served": bad_copy(adapters["qv"], tmp_path / "dora", dora),
        "another base model": write_adapter(other_base, tmp_path / "other_ad", ["q_proj"], 4, 8),
        "is not served": write_adapter(base, tmp_path / "head", ["lm_head"], 4, 8),
    }
    running = engine.add_request(prompts(1)[0], SamplingParams(max_tokens=4),
                                 lora_request=LoRARequest("qv", 4, adapters["qv"]))
    for i, (why, path) in enumerate(cases.items()):
        name = f"bad{i}"
        with pytest.raises(LoRAAdapterError, match=why) as e:
            engine.add_request(prompts(1)[0], GREEDY, lora_request=LoRARequest(name, 100 + i, path))
        assert repr(name) in str(e.value)  # the adapter is named
    assert 4 in engine.list_loras() and not engine.list_loras() & set(range(100, 110))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.output(running).output_token_ids) == 4


def test_same_prompt_under_two_adapters_never_shares_kv(engine, lora_models):
    base, adapters = lora_models
    qv, attn = LoRARequest("qv", 4, adapters["qv"]), LoRARequest("attn2", 7, adapters["attn"])
    p = prompts(1, seed=9)[0] * 2  # 3+ full blocks
    first = engine.generate([p], GREEDY, lora_request=qv)[0]
    assert first.num_cached_tokens == 0
    assert engine.generate([p], GREEDY, lora_request=attn)[0].num_cached_tokens == 0
    assert engine.generate([p], GREEDY)[0].num_cached_tokens == 0  # nor the base model
    again = engine.generate([p], GREEDY, lora_request=qv)[0]  # the same adapter hits its own blocks
    assert again.num_cached_tokens >= 32 and again.output_token_ids == first.output_token_ids


def test_planner_chains_start_at_the_request_root():
    planner = Planner(num_blocks=32, block_size=16, num_query_heads=4, num_kv_heads=2)
    toks = list(range(40))
    planner.plan([ScheduledRequest("a", toks, cache_root=11, lora_slot=0)])
    assert planner.num_cached_tokens(toks, root=11) == 32
    assert planner.num_cached_tokens(toks) == 0 and planner.num_cached_tokens(toks, root=12) == 0
    plan = planner.plan([ScheduledRequest("b", toks, cache_root=11, lora_slot=1), ScheduledRequest("c", toks)])
    assert plan.num_prefix_cache_hit_tokens == 32  # b's hit; c (base) takes none
    assert plan.lora_slots.tolist() == [1, -1]


def test_host_lru_serves_slot_refills_without_the_disk(engine, lora_models):
    """One device slot, two host entries: A, B, A reads the disk twice and fills the slot thrice."""
    _, adapters = lora_models
    lora = engine.executor.worker.lora
    a, b = LoRARequest("lru_a", 20, adapters["attn"]), LoRARequest("lru_b", 21, adapters["mlp"])
    disk, loads = lora.disk_loads, engine.lora.num_loads
    for r in (a, b, a):
        engine.generate([prompts(1)[0]], GREEDY, lora_request=r)
    assert engine.lora.num_loads - loads == 3 and lora.disk_loads - disk == 2


def test_unload_waits_for_no_request_and_refuses_by_name(engine, lora_models):
    _, adapters = lora_models
    req = LoRARequest("busy", 30, adapters["qv"])
    rid = engine.add_request(prompts(1)[0], GREEDY, lora_request=req)
    with pytest.raises(LoRAAdapterError, match="'busy' is in use by 1"):
        engine.remove_lora(30)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.output(rid).output_token_ids) == 3  # never failed
    assert engine.remove_lora(30) and 30 not in engine.list_loras()
    with pytest.raises(LoRAAdapterError, match="unknown adapter"):
        engine.remove_lora(30)


def test_a_request_waiting_for_a_slot_does_not_hold_up_the_queue_behind_it(engine, lora_models):
    """One device slot, held by a running request of adapter A: a request of adapter B must wait,
    but a base-model request and another of A queued behind it are admitted at once; B runs as
    soon as A's requests finish, and every request gets all its tokens.  (With the queue stopped
    at B -- the old admission -- the base request would wait for A's whole run.)"""
    _, adapters = lora_models
    a, b = LoRARequest("slot_a", 40, adapters["attn"]), LoRARequest("slot_b", 41, adapters["mlp"])
    long = SamplingParams(max_tokens=12, ignore_eos=True)
    p = prompts(4)
    ra = engine.add_request(p[0], long, lora_request=a)
    engine.step()  # A takes the only slot
    rb = engine.add_request(p[1], GREEDY, lora_request=b)
    rbase = engine.add_request(p[2], GREEDY)
    ra2 = engine.add_request(p[3], GREEDY, lora_request=a)
    engine.step()
    running = {r.request_id for r in engine.scheduler.running}
    assert rbase in running and ra2 in running and rb not in running
    assert [r.request_id for r in engine.scheduler.waiting] == [rb]
    while engine.has_unfinished_requests():
        engine.step()
    for rid, n in ((ra, 12), (rb, 3), (rbase, 3), (ra2, 3)):
        assert len(engine.output(rid).output_token_ids) == n, rid


def test_an_adapter_checked_once_is_not_read_again_until_its_files_change(lora_models, tmp_path, monkeypatch):
    """check_adapter remembers what read_adapter found for the files as they stand: the engine
    thread's check after the Serve handler's is a stat, not a read of every tensor; a rewritten
    file is read again, and a broken one is refused every time (errors are not remembered)."""
    from ray_attn.lora import peft_format as pf
    from tests.lora.peft_fixture import tiny_model

    _, adapters = lora_models
    folder = shutil.copytree(adapters["attn"], tmp_path / "attn")
    reads = []
    real = pf.read_adapter
    monkeypatch.setattr(pf, "read_adapter", lambda *a, **k: reads.append(a[0]) or real(*a, **k))
    model = tiny_model()
    first = pf.check_adapter(str(folder), "x", model, 8)
    assert pf.check_adapter(str(folder), "x", model, 8) == first and len(reads) == 1
    assert pf.check_adapter(str(folder), "x", model, 16) == first and len(reads) == 2  # another limit: checked again
    cfg = json.load(open(folder / "adapter_config.json"))
    json.dump(cfg | {"lora_alpha": cfg["lora_alpha"] * 2}, open(folder / "adapter_config.json", "w"), indent=2)
    pf.check_adapter(str(folder), "x", model, 8)
    assert len(reads) == 3  # the config changed: read again
    corrupt(str(folder))
    for _ in range(2):
        with pytest.raises(LoRAAdapterError, match="not a readable safetensors"):
            pf.check_adapter(str(folder), "x", model, 8)
    assert len(reads) == 5


def test_a_step_shared_with_other_requests_never_reads_an_adapter_from_disk(lora_models):
    """An adapter new to the ranks arrives while a base request decodes: the rank's prefetch
    thread has the reader process read it, the request waits (the base request's steps go on)
    until rank 0 reports it, and then decodes the same tokens as alone.  With nothing else
    running, the step reads it itself."""
    base, adapters = lora_models
    cfg = engine_config(base, max_loras=2, max_lora_rank=8, max_cpu_loras=2)
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    rank = eng.executor.worker.lora
    try:
        alone = eng.generate([prompts(2)[1]], SamplingParams(max_tokens=4),
                             lora_request=LoRARequest("alone", 1, adapters["attn"]))[0].output_token_ids
        assert [r[1] for r in rank.reads] == ["MainThread"]  # nothing else ran: the step read it itself
        req = LoRARequest("late", 2, adapters["attn"])
        eng.add_request(prompts(1)[0], SamplingParams(max_tokens=40), request_id="base")
        eng.step()
        eng.add_request(prompts(2)[1], SamplingParams(max_tokens=4), request_id="late", lora_request=req)
        eng.step()  # the base request's step; it carries the prefetch
        assert "late" not in {r.request_id for r in eng.scheduler.running}  # waits for its adapter
        while eng.has_unfinished_requests():
            eng.step()
        assert [r[:2] for r in rank.reads][1:] == [(2, "lora-prefetch_0")]
        assert rank.reader is not None and rank.reader_failed is None  # read in the reader process
        # one torch thread on the prefetch thread: a second OpenMP team as wide as the rank's
        # slowed every later step of the rank 2-5x on CPU
        assert rank._pool.submit(torch.get_num_threads).result() == 1
        # and a short GIL switch interval: each GIL take of the step's thread waited up to 5 ms
        # while that thread ran Python (scripts/probe_lora_read_stall.py)
        import sys

        from ray_attn.lora.layers import SWITCH_INTERVAL_S
        assert sys.getswitchinterval() <= SWITCH_INTERVAL_S
        assert eng.lora.num_prefetches == 1
        assert eng.output("late").output_token_ids == alone
        assert len(eng.output("base").output_token_ids) == 40
    finally:
        eng.shutdown()


def test_without_a_reader_process_the_prefetch_thread_reads_the_adapter_itself(lora_models, monkeypatch):
    from ray_attn.lora import layers

    def refuse(*a, **k):
        raise OSError("spawn refused")

    monkeypatch.setattr(layers, "ReaderProcess", refuse)
    base, adapters = lora_models
    cfg = engine_config(base, max_loras=2, max_lora_rank=8)
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    rank = eng.executor.worker.lora
    eng.add_request(prompts(1)[0], SamplingParams(max_tokens=40), request_id="base")
    eng.step()
    eng.add_request(prompts(2)[1], SamplingParams(max_tokens=4), request_id="late",
                    lora_request=LoRARequest("late", 2, adapters["mlp"]))
    while eng.has_unfinished_requests():
        eng.step()
    assert rank.reader is None and rank.reader_failed == "OSError: spawn refused"
    assert [r[:2] for r in rank.reads] == [(2, "lora-prefetch_0")]
    assert len(eng.output("late").output_token_ids) == 4


def test_a_load_for_a_later_step_is_copied_after_the_forward_of_the_step_it_rides_on(lora_models):
    """An adapter the ranks hold in host memory but in no slot, asked for while a base request
    decodes: its load rides on one step whose rows do not use the slot, and is made after that
    step's forward is queued (on a GPU, on a copy stream beside it); the request runs from the
    next step, with no load, and decodes what it decodes alone."""
    base, adapters = lora_models
    cfg = engine_config(base, max_loras=1, max_lora_rank=8, max_cpu_loras=2)
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    worker, rank = eng.executor.worker, eng.executor.worker.lora
    a, b = LoRARequest("a", 1, adapters["attn"]), LoRARequest("b", 2, adapters["mlp"])
    try:
        alone = eng.generate([prompts(2)[1]], SamplingParams(max_tokens=4), lora_request=a)[0].output_token_ids
        eng.generate([prompts(2)[0]], SamplingParams(max_tokens=2), lora_request=b)  # b takes the one slot
        assert eng.lora.slot_of == {2: 0} and 1 in eng.lora.host_ready
        events = []
        forward, load = worker._forward, rank.load
        worker._forward = lambda step: events.append("forward") or forward(step)
        rank.load = lambda loads, stream=None: events.append(("load", [ld[1] for ld in loads])) or load(loads, stream)
        eng.add_request(prompts(1)[0], SamplingParams(max_tokens=12), request_id="base")
        eng.step()
        eng.add_request(prompts(2)[1], SamplingParams(max_tokens=4), request_id="late", lora_request=a)
        events.clear()
        eng.step()  # the base request's step, carrying a's load for the next
        assert events == ["forward", ("load", [1])]
        assert "late" not in {r.request_id for r in eng.scheduler.running}
        events.clear()
        eng.step()
        assert events == ["forward"] and "late" in {r.request_id for r in eng.scheduler.running}
        while eng.has_unfinished_requests():
            eng.step()
        assert eng.output("late").output_token_ids == alone
        assert eng.lora.num_prefetches == 0  # it was in host memory: nothing to read
    finally:
        eng.shutdown()


def test_a_load_ahead_never_strands_its_request():
    """A load asked a step ahead (other requests running) whose step never comes -- the others
    ended -- is made in the step that then runs the request."""
    from types import SimpleNamespace

    from ray_attn.lora.manager import LoRAManager

    cfg = SimpleNamespace(lora_config=SimpleNamespace(max_loras=1, cpu_capacity=2), model=None)
    m = LoRAManager(cfg)
    m.adapters[7] = LoRARequest("x", 7, "/nowhere")
    m.host_ready[7] = None
    assert m.slot_for(7, set, shared=True) is None and m.ahead == {7}
    assert m.slot_for(7, set, shared=True) is None  # still ahead while others run
    assert m.slot_for(7, set, shared=False) == 0  # alone now: this step loads and runs it
    assert m.take_loads() == [(0, 7, "x", "/nowhere")] and m.ahead == set()
    assert m.slot_for(7, set, shared=True) == 0  # resident


def test_a_load_ahead_owed_by_a_step_whose_forward_raised_is_made_before_the_next(lora_models):
    """A step's loads for later steps are made after its forward; a forward that raises never
    gets there.  The driver counts the slot as loaded, so the next step makes the owed load
    before its own forward."""
    import numpy as np
    from types import SimpleNamespace

    base, adapters = lora_models
    cfg = engine_config(base, max_loras=1, max_lora_rank=8, max_cpu_loras=2)
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    rank = eng.executor.worker.lora
    try:
        plan = SimpleNamespace(lora_slots=np.array([-1], np.int32), query_lens=np.array([1], np.int32), num_tokens=1)
        put = lambda name, host: torch.from_numpy(host)  # noqa: E731
        rank.begin_step(plan, [(0, 5, "owed", adapters["attn"])], put)  # no row uses slot 0: ahead
        assert rank.slot_ids[0] == 0 and rank._ahead
        # (the forward raised: after_forward never ran)
        rank.begin_step(plan, None, put)
        assert rank.slot_ids[0] == 5 and not rank._ahead
    finally:
        eng.shutdown()
