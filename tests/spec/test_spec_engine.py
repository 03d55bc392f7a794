"""Speculative decoding (n-gram) through the engine, against the same engine without it: an
in-process rank on CPU, a small random model.  Prompts built to repeat (the model then repeats
too, and drafts are accepted) and random ones (drafts rejected) in the same batches.

Greedy tokens are the same token for token; seeded sampling too (the rejection sampler draws
each position with the non-speculative sampler's own noise, runtime/spec_decode.py); so are
penalties, logprobs, stops and max_tokens inside an accepted run, n samples of one prompt,
and preemption.  Structured outputs with speculation: tests/spec/test_spec_grammar.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ray_attn.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from ray_attn.engine import LLMEngine, SamplingParams
from ray_attn.runtime import InProcessExecutor

MODEL = dict(vocab_size=384, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, seed=7)
# always on: the batches here are larger than the CPU default limit (test_the_default_limit_is_the_devices)
SPEC = dict(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4, disable_by_batch_size=None)


def config(spec: dict | None = SPEC, num_blocks=160, tp=1, max_num_seqs=16, **model) -> EngineConfig:
    return EngineConfig(model=ModelConfig(**(MODEL | model)), cache=CacheConfig(num_blocks=num_blocks),
                        parallel=ParallelConfig(tensor_parallel_size=tp, device="cpu", num_cpus_per_worker=1),
                        max_num_batched_tokens=256, max_num_seqs=max_num_seqs, speculative_config=spec)


def engine(spec: dict | None = SPEC, **kw) -> LLMEngine:
    cfg = config(spec, **kw)
    return LLMEngine(cfg, InProcessExecutor(cfg))


def prompts(n_repeating=6, n_random=6, seed=1) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    rep = [rng.integers(0, 384, 12).tolist() * 3 for _ in range(n_repeating)]
    return rep + [rng.integers(0, 384, 40).tolist() for _ in range(n_random)]


@pytest.fixture(scope="module")
def engines():
    return engine(None), engine()


def spec_stats(eng) -> dict:
    return dataclasses.asdict(eng.spec.stats)


def delta(after: dict, before: dict) -> dict:
    return {k: ([a - b for a, b in zip(v, before[k])] if isinstance(v, list) else v - before[k])
            for k, v in after.items()}


def tokens(outs) -> list[list[int]]:
    return [o.output_token_ids for o in outs]


def test_greedy_with_speculation_is_greedy_without(engines):
    plain, spec = engines
    ps = prompts()
    want = tokens(plain.generate(ps, SamplingParams(max_tokens=24)))
    assert len({tuple(t) for t in want}) == len(want)  # the outputs depend on the prompts
    before = spec_stats(spec)
    assert tokens(spec.generate(ps, SamplingParams(max_tokens=24))) == want
    d = delta(spec_stats(spec), before)
    assert d["num_accepted_tokens"] > 10, d  # drafts were accepted ...
    assert d["num_draft_tokens"] - d["num_accepted_tokens"] > 10, d  # ... and rejected
    per_pos = d["num_accepted_tokens_per_pos"]
    assert sum(per_pos) == d["num_accepted_tokens"] and per_pos == sorted(per_pos, reverse=True)
    s = spec.stats
    assert s.spec_num_drafts == spec.spec.stats.num_drafts and s.spec_mean_acceptance_length == pytest.approx(
        1 + s.spec_num_accepted_tokens / s.spec_num_drafts)
    spec.planner.pool.check_invariants()
    assert spec.planner.stats()["num_used_blocks"] == 0 and spec.planner.num_requests == 0


def test_seeded_sampling_penalties_logprobs_and_n_samples_are_the_non_speculative_ones(engines):
    plain, spec = engines
    ps = prompts(4, 2, seed=2)
    kinds = [SamplingParams(max_tokens=20, repetition_penalty=1.3, logprobs=3),
             SamplingParams(max_tokens=20, temperature=0.9, seed=5, top_k=30, top_p=0.9, logprobs=2),
             SamplingParams(max_tokens=20, presence_penalty=0.4, frequency_penalty=0.3, min_p=0.05,
                            temperature=0.7, seed=11),
             SamplingParams(max_tokens=20, logit_bias=((5, 2.0),), logprobs=0)]
    params = [kinds[i % len(kinds)] for i in range(len(ps))]
    # n = 6 samples of a prompt whose output starts with accepted drafts, at a temperature where
    # drafts are accepted and the seeds still part the samples: each position's draw must be
    # that of its own token index; and light penalties, whose history must end at each position
    loop = looping_prompt(plain)
    ps += [loop] * 8
    params += [SamplingParams(max_tokens=24, temperature=0.12, seed=s) for s in range(6)]
    params += [SamplingParams(max_tokens=24, repetition_penalty=1.05, logprobs=1),
               SamplingParams(max_tokens=24, frequency_penalty=0.1, presence_penalty=0.05)]
    want = plain.generate(ps, params)
    assert len({tuple(t) for t in tokens(want[-8:-2])}) == 6
    before = spec_stats(spec)
    got = spec.generate(ps, params)
    assert tokens(got) == tokens(want)
    assert delta(spec_stats(spec), before)["num_accepted_tokens"] > 10
    for g, w in zip(got, want):
        if w.logprobs is not None:
            assert [t.token_id for t in g.logprobs] == w.output_token_ids
            np.testing.assert_allclose([t.logprob for t in g.logprobs], [t.logprob for t in w.logprobs], atol=1e-4)
            assert [[i for i, _ in t.top] for t in g.logprobs] == [[i for i, _ in t.top] for t in w.logprobs]
    # a seeded request alone gives what it gave in the batch (its draws follow its token index)
    alone = spec.generate([ps[-3]], [params[-3]])[0]
    assert alone.output_token_ids == got[-3].output_token_ids


def record_emitted(eng) -> list:
    """Every step's emitted tokens of each row, as the engine reads them (None: a step that
    verified no drafts, one token a row)."""
    seen, take = [], eng.spec.take

    def recording(step_id, token_ids):
        got = take(step_id, token_ids)
        seen.append(None if got is None else got[1])
        return got

    eng.spec.take = recording
    return seen


def runs_inside(seen: list) -> list[tuple[int, int]]:
    """For one request's steps: (output position, token) of every token a step emitted with
    accepted tokens after it."""
    out, pos = [], 0
    for step in seen:
        run = [None] if step is None else step[0]
        out += [(pos + i, t) for i, t in enumerate(run[:-1])]
        pos += len(run)
    return out


def looping_prompt(plain) -> list[int]:
    """A prompt that ends in the loop the model falls into after it, so that the first output
    tokens are drafts from the prompt, accepted: tokens that first occur inside an accepted run."""
    # The first prompt whose greedy output ends in a loop: seed 3's on CPU in float32; bf16 on a
    # GPU takes another path from the same weights (seed 3 had not looped after 40 tokens there).
    for seed, max_tokens in [(3, 40)] + [(s, 96) for s in range(3, 11)]:
        p = prompts(1, 0, seed=seed)[0]
        ref = tokens(plain.generate([p], SamplingParams(max_tokens=max_tokens)))[0]
        period = next((k for k in range(1, 17) if ref[-2 * k:-k] == ref[-k:]), None)
        if period is not None:
            return p + ref[-period:] * 3
    raise AssertionError("no prompt's greedy output fell into a loop")


def first_inside_a_run(spec, prompt) -> tuple[list[int], int, int]:
    """The output, and the position and token of a token whose first occurrence a step emitted
    with accepted tokens after it."""
    seen = record_emitted(spec)
    try:
        ref = tokens(spec.generate([prompt], SamplingParams(max_tokens=30)))[0]
    finally:
        del spec.spec.take
    at, tok = next((i, t) for i, t in runs_inside(seen) if ref.index(t) == i and i > 0)
    return ref, at, tok


def test_a_stop_or_max_tokens_inside_an_accepted_run_ends_the_request_there(engines):
    plain, spec = engines
    p = looping_prompt(plain)
    ref, stop_at, stop_tok = first_inside_a_run(spec, p)
    assert ref == tokens(plain.generate([p], SamplingParams(max_tokens=30)))[0]
    for params, n, reason in [
            (SamplingParams(max_tokens=30, stop_token_ids=(stop_tok,)), stop_at + 1, "stop"),
            # min_tokens masks the stop token at the positions before it, draft positions too
            (SamplingParams(max_tokens=30, stop_token_ids=(stop_tok,), min_tokens=stop_at + 1), None, None),
            (SamplingParams(max_tokens=stop_at + 1), stop_at + 1, "length")]:
        w, g = plain.generate([p], params)[0], spec.generate([p], params)[0]
        assert g.output_token_ids == w.output_token_ids and g.finish_reason == w.finish_reason
        if n is not None:
            assert g.output_token_ids == ref[:n] and g.finish_reason == reason
        else:
            assert stop_tok not in g.output_token_ids[:stop_at + 1] and g.output_token_ids != ref
    assert spec.planner.stats()["num_used_blocks"] == 0


def test_eos_inside_an_accepted_run(engines):
    p = looping_prompt(engines[0])
    ref, at, eos = first_inside_a_run(engines[1], p)
    want = engine(None, eos_token_ids=[eos]).generate([p], SamplingParams(max_tokens=30))[0]
    got = engine(eos_token_ids=[eos]).generate([p], SamplingParams(max_tokens=30))[0]
    assert got.output_token_ids == want.output_token_ids == ref[:at + 1]
    assert got.finish_reason == "stop"


def test_preemption_recomputes_and_the_drafts_give_way_first(engines):
    plain, _ = engines
    ps = prompts(5, 3, seed=4)
    want = tokens(plain.generate(ps, SamplingParams(max_tokens=24)))
    tight = engine(num_blocks=14)  # 8 requests of up to 4 blocks each: they cannot all run
    undone, undo = [], tight.spec.undo
    tight.spec.undo = lambda out: (undone.append(1), undo(out))
    assert tokens(tight.generate(ps, SamplingParams(max_tokens=24))) == want
    assert tight.stats.preemptions > 0 and undone, (tight.stats.preemptions, len(undone))
    assert tight.spec.stats.num_accepted_tokens > 0
    tight.planner.pool.check_invariants()


def record_steps(eng) -> list[tuple[bool, bool, bool]]:
    """(a flush, deferred, with drafts) of each message the engine sends its ranks."""
    seen, step = [], eng.executor.step
    eng.executor.step = lambda s: (seen.append((s.plan is None, s.defer, s.spec is not None)), step(s))[1]
    return seen


def check_async_steps(seen) -> None:
    """Steps above the batch limit were deferred, steps below it speculated and were not, and
    the engine collected a deferred step before the first speculating step that followed it."""
    assert any(d for f, d, _ in seen if not f) and any(sp for *_, sp in seen), seen
    assert not any(d and sp for _, d, sp in seen), seen
    assert any(f for f, *_ in seen), seen


def test_async_scheduling_defers_the_steps_that_cannot_speculate(engines):
    # 8 requests ending one after another: the batch starts above the limit (steps overlap, none
    # speculates) and shrinks below it (steps speculate, each collected before the next is planned).
    plain, _ = engines
    ps = prompts(4, 4, seed=8)
    params = [SamplingParams(max_tokens=6 + 4 * i) for i in range(len(ps))]
    want = tokens(plain.generate(ps, params))
    eng = engine(SPEC | {"disable_by_batch_size": 3})
    eng.set_async_scheduling(True)
    seen = record_steps(eng)
    assert tokens(eng.generate(ps, params)) == want
    check_async_steps(seen)
    assert eng.spec.stats.num_accepted_tokens > 0
    eng.planner.pool.check_invariants()
    assert eng.planner.stats()["num_used_blocks"] == 0 and eng._submitted is None


def test_disable_by_batch_size():
    ps = prompts(4, 0, seed=5)
    eng = engine(SPEC | {"disable_by_batch_size": 3})
    eng.generate(ps, SamplingParams(max_tokens=12))  # 4 running all the way: none speculates
    assert eng.spec.stats.num_drafts == 0
    eng.generate(ps[:3], SamplingParams(max_tokens=12))
    assert eng.spec.stats.num_drafts > 0


def test_tp2_over_ray_gives_the_single_process_greedy_tokens(shared_ray, engines):
    plain, _ = engines
    ps = [looping_prompt(plain)] + prompts(2, 2, seed=6)
    want = tokens(plain.generate(ps, SamplingParams(max_tokens=16)))
    eng = LLMEngine(config(tp=2))
    try:
        assert tokens(eng.generate(ps, SamplingParams(max_tokens=16))) == want
        assert eng.spec.stats.num_accepted_tokens > 0
    finally:
        eng.shutdown()
