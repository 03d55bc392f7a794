"""Speculative decoding with a draft model (``method='draft_model'``), through the engine on CPU,
against the same engine without speculation.

Two drafts: the target itself (same shapes and seed), whose every draft the target accepts while
the draft's KV cache is right -- so the acceptance counts check the draft's cache bookkeeping
(catch-up, passes, preemption), which the output alone cannot show, verification being exact
whatever the drafts are -- and a smaller, different model, whose drafts are nearly all rejected.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_attn.config import CacheConfig, EngineConfig
from ray_attn.engine import LLMEngine, SamplingParams
from ray_attn.runtime import InProcessExecutor
from ray_attn.runtime.messages import DraftInputs
from ray_attn.spec.draft_inputs import build_draft_inputs
from tests.spec.test_spec_engine import (MODEL, check_async_steps, config, engine, prompts, record_steps,
                                         tokens)
from tests.spec.test_spec_grammar import tok  # noqa: F401 -- the test tokenizer fixture

SELF = dict(method="draft_model", num_speculative_tokens=4, draft_model_config=MODEL, disable_by_batch_size=None)
OTHER = SELF | dict(num_speculative_tokens=3, draft_model_config=MODEL | dict(seed=11, num_hidden_layers=1,
                                                                              intermediate_size=128))


@pytest.fixture(scope="module")
def plain():
    return engine(None)


@pytest.fixture(scope="module")
def want(plain):
    return tokens(plain.generate(prompts(), SamplingParams(max_tokens=24)))


def rank(eng):
    return eng.executor.worker


def all_accepted(eng) -> bool:
    s = eng.spec.stats
    return s.num_drafts > 0 and s.num_accepted_tokens == s.num_draft_tokens


def test_a_self_draft_is_always_accepted_and_greedy_is_unchanged(want):
    eng = engine(SELF)
    assert tokens(eng.generate(prompts(), SamplingParams(max_tokens=24))) == want
    s = eng.spec.stats
    assert all_accepted(eng), s
    assert s.num_draft_tokens > 3 * s.num_drafts  # k=4 but near max_tokens
    assert rank(eng).draft.failures == 0
    eng.planner.pool.check_invariants()
    assert eng.planner.stats()["num_used_blocks"] == 0


def test_another_draft_is_mostly_rejected_and_greedy_is_unchanged(want):
    eng = engine(OTHER)
    assert tokens(eng.generate(prompts(), SamplingParams(max_tokens=24))) == want
    s = eng.spec.stats
    assert s.num_drafts > 50 and s.num_accepted_tokens < s.num_draft_tokens / 4, s


def test_seeded_sampling_is_the_non_speculative_draw(plain):
    ps = prompts(3, 3, seed=2)
    params = [SamplingParams(max_tokens=20, temperature=0.9, seed=100 + i) for i in range(len(ps))]
    expect = tokens(plain.generate(ps, params))
    for spec in (SELF, OTHER):
        assert tokens(engine(spec).generate(ps, params)) == expect


def test_preempted_requests_restart_the_drafts_cache(plain):
    # 12 requests of up to 5 blocks in 18: preemption gives their blocks to others.  A draft that
    # kept its count across it would read other requests' KV, and its drafts would be rejected.
    # Without the prefix cache, a preempted request's prefill lands in whatever blocks are free.
    cfg = config(SELF, num_blocks=18).model_copy(
        update={"cache": CacheConfig(num_blocks=18, enable_prefix_caching=False)})
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    drafted_victims, preempt = [], eng.scheduler.preempt_one
    eng.scheduler.preempt_one = lambda: (drafted_victims.append(eng.scheduler.running[-1].num_draft_computed > 0),
                                         preempt())[1]
    params = SamplingParams(max_tokens=40)
    assert tokens(eng.generate(prompts(), params)) == tokens(plain.generate(prompts(), params))
    assert any(drafted_victims), drafted_victims  # requests were preempted after they speculated
    assert all_accepted(eng), eng.spec.stats


def test_rows_that_did_not_speculate_catch_up_in_one_query(plain, monkeypatch):
    # Above the batch limit nothing speculates; as requests finish, the rows left speculate and
    # first catch up on the tokens they made without the draft, in one query -- their prompts the
    # draft computed alongside the target's prefill.
    import ray_attn.spec.decoder as decoder

    ps = prompts()
    params = [SamplingParams(max_tokens=8 + 3 * i) for i in range(len(ps))]
    eng = engine(SELF | dict(disable_by_batch_size=4))
    catch_ups = []

    def build(plan, reqs, k, block_size):
        d = build_draft_inputs(plan, reqs, k, block_size)
        for i, r in enumerate([] if d is None else d.rows.tolist()):
            if d.num_draft_tokens[i]:
                q = d.metadata.query_start_loc
                catch_ups.append((int(q[i + 1] - q[i]), int(d.positions[q[i]]) - reqs[r].num_prompt_tokens))
        return d

    monkeypatch.setattr(decoder, "build_draft_inputs", build)
    assert tokens(eng.generate(ps, params)) == tokens(plain.generate(ps, params))
    assert all_accepted(eng), eng.spec.stats
    assert max(n for n, _ in catch_ups) > 5  # tokens decoded without drafts, caught up at once
    assert min(after for _, after in catch_ups) >= 0  # never the prompt: computed with the prefill


def test_async_scheduling_overlaps_the_steps_above_the_batch_limit(plain):
    # Above the limit the steps are deferred, the draft computing only prompt chunks in them; below
    # it they speculate, collected first.  A self-draft accepts everything only if the catch-ups
    # after the deferred steps read the right tokens at the right slots.
    ps = prompts(4, 4, seed=8)
    params = [SamplingParams(max_tokens=6 + 4 * i) for i in range(len(ps))]
    eng = engine(SELF | dict(disable_by_batch_size=3))
    eng.set_async_scheduling(True)
    seen = record_steps(eng)
    assert tokens(eng.generate(ps, params)) == tokens(plain.generate(ps, params))
    check_async_steps(seen)
    assert all_accepted(eng), eng.spec.stats
    assert rank(eng).draft.failures == 0


def test_prompts_are_computed_alongside_so_catch_ups_are_two_tokens(monkeypatch):
    import ray_attn.spec.decoder as decoder

    # the prompts' prefill steps leave no budget for drafts; from then on every row verifies 4
    # drafts a step (chunked prompts: test_the_drafts_slots_are_the_targets)
    eng = engine(SELF)
    lengths = []

    def build(plan, reqs, k, block_size):
        d = build_draft_inputs(plan, reqs, k, block_size)
        if d is not None:
            q = np.diff(d.metadata.query_start_loc)
            lengths.extend(q[np.asarray(d.num_draft_tokens) > 0].tolist())
        return d

    monkeypatch.setattr(decoder, "build_draft_inputs", build)
    eng.generate(prompts(), SamplingParams(max_tokens=16))
    assert lengths and set(lengths) == {2}, lengths
    assert all_accepted(eng), eng.spec.stats


def test_a_prefix_cache_hit_starts_the_draft_where_the_target_starts(monkeypatch):
    import ray_attn.spec.decoder as decoder

    eng = engine(SELF)
    starts = []

    def build(plan, reqs, k, block_size):
        d = build_draft_inputs(plan, reqs, k, block_size)
        for i, r in enumerate([] if d is None else d.rows.tolist()):
            if not d.num_draft_tokens[i]:  # a chunk row: where its catch-up starts, where the target's does
                starts.append((int(d.positions[d.metadata.query_start_loc[i]]), int(plan.num_computed_tokens[r])))
        return d

    monkeypatch.setattr(decoder, "build_draft_inputs", build)
    first = prompts(1, 0)[0]
    eng.generate([first], SamplingParams(max_tokens=8))
    out = eng.generate([first[:32] + [5, 6, 7, 8, 9]], SamplingParams(max_tokens=16))
    assert out[0].num_cached_tokens == 32 and starts[-1] == (32, 32), starts
    assert all_accepted(eng), eng.spec.stats  # the shared blocks' draft KV was right


def engine_with(spec, **engine_fields):
    cfg = config(spec).model_copy(update=engine_fields)
    return LLMEngine(cfg, InProcessExecutor(cfg))


def test_penalized_rows_speculate_and_equal_the_plain_run(plain):
    ps = prompts(3, 3, seed=3)
    params = [SamplingParams(max_tokens=16, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(max_tokens=16, temperature=0.8, seed=9, repetition_penalty=1.2)] * 3
    eng = engine(SELF)
    assert tokens(eng.generate(ps, params)) == tokens(plain.generate(ps, params))
    s = eng.spec.stats
    assert s.num_drafts > 10 and s.num_accepted_tokens > 10, s  # accepted and rejected runs


def test_the_drafts_reach_the_penalties_histories_on_rank_0():
    """Each draft position's penalties see the drafts before it.  Made on the ranks, a draft
    model's drafts are 0 in the driver's histories and rank 0 writes them in
    (``history_draft_index``): the penalised logits equal those of the same step with the drafts
    known on the driver, as n-gram drafts are."""
    from ray_attn.request import Request
    from ray_attn.runtime.messages import SpecDecodeInputs
    from ray_attn.runtime.sampling import SamplingTensors, apply_raw_processors
    from ray_attn.sampling_inputs import build_sampling_inputs

    V, drafts, k = 32, [7, 7, 9], 3
    params = SamplingParams(max_tokens=20, repetition_penalty=2.0, presence_penalty=1.5, frequency_penalty=1.0)
    logits = torch.randn(k + 1, V, generator=torch.Generator().manual_seed(0))
    ends = [5, 6, 7, 8]  # the history of logits row j: the 5 tokens before the drafts, then j drafts

    def penalised(draft_tokens, draft_ranges, fill):
        req = Request("r", [1, 2, 3, 7, 5], 3, params)
        req.append_drafts(draft_tokens)
        si = build_sampling_inputs([req] * (k + 1), [True] * (k + 1), np.arange(2, 6, dtype=np.int32), frozenset(),
                                   V, history_ends=ends, draft_ranges=draft_ranges)
        spec = SpecDecodeInputs(np.array([k], np.int32), np.array(draft_tokens, np.int32), np.arange(k + 1))
        st = SamplingTensors.stage(np.zeros(k + 1, np.float32), np.full(k + 1, -1), np.arange(2, 6, dtype=np.int32),
                                   torch.device("cpu"), inputs=si, spec=spec)
        if fill:  # what the worker does once the draft has run
            st.spec_draft_ids = torch.tensor(drafts)
        return apply_raw_processors(logits, st)

    known = penalised(drafts, None, False)
    torch.testing.assert_close(penalised([0] * k, [(5, 0)] * (k + 1), True), known, rtol=0, atol=0)
    assert not torch.equal(penalised([0] * k, None, False), known)  # zeros there would differ


def test_a_failing_draft_leaves_the_output_unchanged(want, monkeypatch):
    from ray_attn.runtime.draft_runner import RankDraft

    def broken(self, *a):
        raise RuntimeError("draft pass broke")

    monkeypatch.setattr(RankDraft, "_passes", broken)
    eng = engine(SELF)
    with pytest.warns(UserWarning, match="the draft model failed .*draft pass broke"):
        got = tokens(eng.generate(prompts(), SamplingParams(max_tokens=24)))
    assert got == want
    assert rank(eng).draft.failures > 0


def test_a_draft_read_from_a_checkpoint(tmp_path, want):
    from ray_attn.config import ModelConfig
    from ray_attn.model.registry import save_random_checkpoint

    save_random_checkpoint(ModelConfig(**MODEL), str(tmp_path), MODEL["seed"])
    eng = engine(dict(method="draft_model", num_speculative_tokens=2, model=str(tmp_path),
                      disable_by_batch_size=None))
    assert tokens(eng.generate(prompts(), SamplingParams(max_tokens=24))) == want
    assert all_accepted(eng), eng.spec.stats


def test_the_drafts_slots_are_the_targets(monkeypatch):
    """Each draft row writes where the target does: a prompt chunk's tokens in the chunk's slots,
    a speculating row's catch-up ending on its last sampled token, and pass j's draft j in the
    verifying query's slot for it."""
    import ray_attn.spec.decoder as decoder

    eng = engine_with(SELF, max_num_batched_tokens=32)  # the 39-token prompt comes in two chunks
    captured = []

    def build(plan, reqs, k, block_size):
        captured.append((plan, build_draft_inputs(plan, reqs, k, block_size)))
        return captured[-1][1]

    monkeypatch.setattr(decoder, "build_draft_inputs", build)
    # a 39-token prompt crosses pages (16 tokens each): its chunks, catch-up and passes span blocks
    eng.generate([list(range(1, 40)), list(range(50, 60))], SamplingParams(max_tokens=10))
    kinds = set()
    for plan, d in captured:
        if d is None:
            continue
        m = plan.attn
        qsl, slots = np.asarray(m.query_start_loc), np.asarray(m.slot_mapping)
        cq = np.asarray(d.metadata.query_start_loc)
        for i, r in enumerate(d.rows.tolist()):
            first, end, k = qsl[r], qsl[r + 1], int(d.num_draft_tokens[i])
            if k == 0:  # a prompt chunk, computed by the draft alongside the target
                kinds.add("chunk")
                tail = slice(cq[i + 1] - (end - first), cq[i + 1])
                assert list(d.metadata.slot_mapping[tail]) == list(slots[first:end])
                assert list(d.input_token_ids[tail]) == list(plan.input_token_ids[first:end])
                continue
            kinds.add("spec")
            # the verifying query: the last sampled token, then the drafts; the catch-up ends on
            # the last sampled token, in its slot and position
            assert d.metadata.slot_mapping[cq[i + 1] - 1] == slots[first]
            assert d.positions[cq[i + 1] - 1] == plan.positions[first]
            for j, p in enumerate(d.passes, start=1):  # pass j writes draft j where the target will
                at = np.flatnonzero(p.rows == i)
                if len(at):
                    assert p.metadata.slot_mapping[at[0]] == slots[first + j]
                    assert p.positions[at[0]] == plan.positions[first + j]
            owner = np.repeat(np.arange(len(d.rows)), d.num_draft_tokens)
            assert list(d.target_index[owner == i]) == list(range(first + 1, end))
    assert kinds == {"chunk", "spec"}


def test_a_step_with_bad_draft_inputs_is_refused_by_name():
    import dataclasses

    eng = engine(SELF)
    w = rank(eng)
    captured = []
    run = w._run
    w._run = lambda step: captured.append(step) or run(step)
    eng.generate(prompts(2, 0), SamplingParams(max_tokens=6))
    step = next(s for s in captured if s.spec is not None)
    d: DraftInputs = step.draft
    bad = dataclasses.replace(step, draft=dataclasses.replace(
        d, target_index=d.target_index + step.plan.attn.num_actual_tokens))
    with pytest.raises(ValueError, match="draft.target_index must lie in"):
        w._check(bad)
    slots = d.metadata.slot_mapping.copy()
    slots[-1] = w.num_blocks * eng.config.cache.block_size
    bad = dataclasses.replace(step, draft=dataclasses.replace(d, metadata=dataclasses.replace(d.metadata,
                                                                                               slot_mapping=slots)))
    with pytest.raises(ValueError, match="outside the cache"):
        w._check(bad)
    bad = dataclasses.replace(step, draft=dataclasses.replace(d, num_draft_tokens=d.num_draft_tokens * 0))
    with pytest.raises(ValueError, match="draft.num_draft_tokens must be spec.num_draft_tokens"):
        w._check(bad)
    plain = engine(None)
    with pytest.raises(ValueError, match="no draft model"):
        rank(plain)._check(step)


def test_tp2_over_ray_gives_the_single_process_tokens(shared_ray, want):
    eng = LLMEngine(config(SELF, tp=2))
    try:
        assert tokens(eng.generate(prompts(), SamplingParams(max_tokens=24))) == want
        assert all_accepted(eng), eng.spec.stats
    finally:
        eng.shutdown()


def graph_config(device="cpu", dtype="float32"):
    from tests.spec import test_spec_graphs as g

    cfg = g.config(device, dtype)
    draft = cfg.model.model_dump(exclude_unset=True)
    spec = dict(method="draft_model", num_speculative_tokens=g.K, draft_model_config=draft, disable_by_batch_size=None)
    return EngineConfig.model_validate(cfg.model_dump(exclude_unset=True) | {"speculative_config": spec})


def test_verifying_steps_through_the_graph_runner_take_the_ranks_drafts():
    from tests.spec import test_spec_graphs as g

    prompts, params = g.workload()
    want = [o.output_token_ids for o in engine_of(g.EagerExecutor, g.config(spec=False)).generate(prompts, params)]
    ex_eng = engine_of(g.GraphExecutor, graph_config())
    assert [o.output_token_ids for o in ex_eng.generate(prompts, params)] == want
    assert ex_eng.executor.spec_graph_steps >= 5  # the drafts went into the graphs' static inputs
    assert all_accepted(ex_eng), ex_eng.spec.stats


def test_the_drafts_forwards_replay_its_decode_graphs(want):
    # On CPU the graphs' padded static-buffer path runs eagerly (capture=False), as on a GPU
    # minus the capture: the catch-up of one token a row and every pass go through it.
    eng = engine(SELF)
    draft = rank(eng).draft
    draft.capture_graphs(16, capture=False)
    seen, forward = [], draft._forward

    def counted(m, *a, **kw):
        before = draft.replays
        out = forward(m, *a, **kw)
        q = np.diff(np.asarray(m.query_start_loc))
        seen.append((int(q.min()) == int(q.max()) <= 2, draft.replays > before))
        return out

    draft._forward = counted
    assert tokens(eng.generate(prompts(), SamplingParams(max_tokens=24))) == want
    assert all_accepted(eng), eng.spec.stats
    # every forward of one or two tokens a row replayed; only first catch-ups (prompts) did not
    assert all(replayed for uniform, replayed in seen if uniform), seen
    assert sum(replayed for _, replayed in seen) >= 3 * sum(not r for _, r in seen), seen


def engine_of(executor_cls, cfg):
    return LLMEngine(cfg, executor_cls(cfg))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_self_draft_through_captured_graphs_on_gpu():
    """bf16 with FlashAttention and the worker's own captures: the drafts reach the replayed
    verifying graphs, greedy is plain greedy, and the target accepts nearly all of a self-draft
    (bf16: the draft's one-token passes and the verifying query sum in other orders)."""
    from tests.spec import test_spec_graphs as g

    prompts, params = g.workload()
    want = g.plain_tokens(g.config("cuda", "bfloat16", spec=False), prompts, params)
    cfg = graph_config("cuda", "bfloat16")
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    w = eng.executor.worker
    assert w.spec_graphs is not None and w.draft is not None
    replays, replay = [], w.spec_graphs.replay
    w.spec_graphs.replay = lambda *a: replays.append(a) or replay(*a)
    assert [o.output_token_ids for o in eng.generate(prompts, params)] == want
    s = eng.spec.stats
    assert len(replays) >= 5 and w.draft.failures == 0
    assert w.draft.graphs is not None and w.draft.replays > len(replays)  # the draft's passes replayed too
    assert s.num_accepted_tokens >= 0.9 * s.num_draft_tokens, s


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_async_scheduling_on_gpu_gives_the_synchronous_tokens():
    """On the GPU with graphs: deferred steps above the batch limit (the ranks fill their inputs
    on the device), speculating steps below it; the tokens are the synchronous engine's, bit for
    bit, since both plan the same steps."""
    from tests.spec import test_spec_graphs as g

    prompts, _ = g.workload()
    params = [SamplingParams(max_tokens=n) for n in (10, 16, 22, 28, 34)]  # 5 running, then fewer
    outs = {}
    for on in (False, True):
        cfg = graph_config("cuda", "bfloat16")
        cfg = cfg.model_copy(update={"speculative_config": cfg.speculative_config.model_copy(
            update={"disable_by_batch_size": 3})})
        eng = LLMEngine(cfg, InProcessExecutor(cfg))
        eng.set_async_scheduling(on)
        seen = record_steps(eng)
        outs[on] = [o.output_token_ids for o in eng.generate(prompts, params)]
        if on:
            check_async_steps(seen)
        assert eng.spec.stats.num_drafts > 0 and eng.executor.worker.draft.failures == 0
    assert outs[True] == outs[False]


def test_the_fp8_kv_cache_with_scales_from_the_first_batch():
    """The draft's cache is fp8 too, its scales taken from its own first batch like the target's."""
    from ray_attn.model.attention import ParallelAttention

    def fp8(spec):
        cfg = config(spec)
        cfg = cfg.model_copy(update={"cache": CacheConfig(num_blocks=160, kv_cache_dtype="fp8",
                                                          calculate_kv_scales=True)})
        return LLMEngine(cfg, InProcessExecutor(cfg))

    ps = prompts(3, 3)
    want = tokens(fp8(None).generate(ps, SamplingParams(max_tokens=16)))
    eng = fp8(SELF)
    draft = rank(eng).draft
    layers = [m.attn_layer for m in draft.model.modules() if isinstance(m, ParallelAttention)]
    assert layers and all(a.calculate_kv_scales for a in layers)
    assert tokens(eng.generate(ps, SamplingParams(max_tokens=16))) == want
    assert not any(a.calculate_kv_scales for a in layers)  # taken, from the draft's first batch
    s = eng.spec.stats
    assert s.num_accepted_tokens >= 0.9 * s.num_draft_tokens > 0, s


def test_a_gguf_target_with_its_own_gguf_as_the_draft(tmp_path):
    from ray_attn.config import ParallelConfig
    from tests.model.gguf_fixture import tiny_hf, write_gguf

    path = write_gguf(tiny_hf("llama", seed=4), tmp_path / "tiny.gguf", "Q8_0")

    def gguf_engine(spec):
        cfg = EngineConfig(checkpoint=str(path), cache=CacheConfig(num_blocks=64), speculative_config=spec,
                           parallel=ParallelConfig(device="cpu", kernel="torch"), max_num_batched_tokens=64)
        return LLMEngine(cfg, InProcessExecutor(cfg))

    rng = np.random.default_rng(2)
    eng = gguf_engine(dict(method="draft_model", num_speculative_tokens=3, model=str(path),
                           disable_by_batch_size=None))
    ps = [rng.integers(0, eng.config.model.vocab_size, int(n)).tolist() for n in (9, 23, 31)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    assert tokens(eng.generate(ps, params)) == tokens(gguf_engine(None).generate(ps, params))
    assert all_accepted(eng), eng.spec.stats


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_constrained_rows_speculate_through_rank_0s_matchers(backend, tok):
    """A draft model's drafts are unknown to the driver, so nothing cuts them to the grammar:
    rank 0's matchers take them on trial, a refused one is rejected, and the tokens are the
    plain engine's (the workload of tests/spec/test_spec_grammar.py).  The draft is the target
    unconstrained, so most of its drafts leave the grammar and few are accepted."""
    from ray_attn.structured_output import GrammarCompiler
    from tests.spec.test_spec_engine import looping_prompt
    from tests.spec.test_spec_grammar import SPECS

    # engines of their own: rank 0 keeps a spec's compiled grammar, whichever backend compiled it
    plain, spec = engine(None), engine(SELF)
    for eng in (plain, spec):
        eng.grammar_compiler = GrammarCompiler(tok, MODEL["vocab_size"], [2], backend=backend)
    params = [SamplingParams(max_tokens=40, structured_outputs=s, temperature=t, seed=i)
              for i, (s, t) in enumerate((s, t) for t in (0.0, 1.0) for s in SPECS)]
    batch = [looping_prompt(plain)] * len(params)
    verified, accept = [], spec.spec.accept

    def recording(req, row, layout, emitted):
        if req.grammar is not None and layout.num_drafts[row]:
            verified.append((int(layout.num_drafts[row]), len(emitted) - 1))
        return accept(req, row, layout, emitted)

    spec.spec.accept = recording
    assert tokens(spec.generate(batch, params)) == tokens(plain.generate(batch, params))
    # rows verified drafts, most of them refused by rank 0's matchers (the accepted path under a
    # grammar is n-gram's: tests/spec/test_spec_grammar.py)
    assert len(verified) >= 20 and sum(k - a for k, a in verified) >= 60, verified


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_rank_0s_matchers_take_the_ranks_drafts_not_the_plans_zeros(backend):
    """The masks of a draft-model step, whose plan holds 0 at the draft positions and whose
    drafts rank 0 passes in, are those of the same step with the drafts in the plan (n-gram's)."""
    from types import SimpleNamespace

    from ray_attn.runtime.grammars import RankGrammars
    from ray_attn.structured_output import GrammarSync, StructuredOutputsParams
    from tests.runtime.test_structured_output import byte_compiler
    from tests.spec.test_spec_grammar import A, B, DASH, Row, step

    compiler = byte_compiler(backend)
    spec = StructuredOutputsParams(regex="(ab-|abc)+c")
    drafts = [B, DASH, A]

    def masks(as_draft_model):
        row, sync, rank = Row(compiler, spec), GrammarSync(), RankGrammars(compiler.vocab_size)
        assert row.driver.accept(A)
        row.out.append(A)
        s = step(sync, row, A, drafts)
        if not as_draft_model:
            return rank.bitmask(s, None)
        s.plan.input_token_ids = np.array([A, 0, 0, 0], np.int32)
        s.draft = SimpleNamespace(target_index=np.array([1, 2, 3], np.int32))
        return rank.bitmask(s, None, np.array(drafts))

    np.testing.assert_array_equal(masks(True), masks(False))
