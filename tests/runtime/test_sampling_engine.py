"""Sampling parameters end to end through the engine (in-process rank on CPU, and TP=2 over Ray):
EOS, ignore_eos, min_tokens, seeded reproducibility across batch mixes and step splits,
penalties checked step by step against the float64 reference on the rank's raw logits, logprobs,
and async scheduling giving what sync gives."""

from __future__ import annotations

import numpy as np
import pytest

from ray_attn.engine import LLMEngine, SamplingParams
from ray_attn.runtime import InProcessExecutor, StepOutput
from tests.runtime import sampling_reference as ref
from tests.runtime.test_engine_tp import config, workload


def engine(cfg, asyn=False):
    cfg = cfg.model_copy(update={"async_scheduling": asyn})
    return LLMEngine(cfg, InProcessExecutor(cfg))


def mixed_params(max_tokens=10):
    """One of each kind, seven rows (``workload()`` has seven prompts, one chunked)."""
    return [
        SamplingParams(max_tokens=max_tokens, repetition_penalty=1.6, logprobs=3),
        SamplingParams(max_tokens=max_tokens, presence_penalty=1.2, frequency_penalty=0.8, logprobs=0),
        SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=5, top_k=20, top_p=0.9, min_p=0.02,
                       repetition_penalty=1.2, logprobs=5),
        SamplingParams(max_tokens=max_tokens),
        SamplingParams(max_tokens=max_tokens, temperature=1.1, seed=9, top_p=0.8, frequency_penalty=-0.5),
        SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=3, min_p=0.1, logprobs=2),
        SamplingParams(max_tokens=max_tokens, repetition_penalty=0.7, presence_penalty=-1.0),
    ]


def greedy_reference(prompt, max_tokens=12, **model):
    return engine(config(**model)).generate([prompt], SamplingParams(max_tokens=max_tokens))[0].output_token_ids


@pytest.mark.parametrize("asyn", [False, True])
def test_eos_stops_ignore_eos_runs_on_min_tokens_masks_it(asyn):
    prompt = workload()[1]
    toks = greedy_reference(prompt)
    eos = toks[3]
    first = toks.index(eos)
    cfg = config(eos_token_ids=[eos])
    eng = engine(cfg, asyn)
    stop, ignore, held = eng.generate([prompt] * 3, [
        SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, ignore_eos=True),
        SamplingParams(max_tokens=12, min_tokens=first + 2)])
    assert stop.output_token_ids == toks[:first + 1] and stop.finish_reason == "stop"
    assert ignore.output_token_ids == toks and ignore.finish_reason == "length"
    out = held.output_token_ids
    assert eos not in out[:first + 2], "min_tokens must keep EOS from being drawn"
    assert out[:first] == toks[:first] and out[first] != eos
    assert held.finish_reason == ("stop" if eos in out else "length")
    if eos in out:
        assert out.index(eos) == len(out) - 1 >= first + 2
    assert eng.planner.stats()["num_used_blocks"] == 0


def test_min_tokens_masks_stop_token_ids_and_ignore_eos_leaves_eos_unmasked():
    prompt = workload()[2]
    toks = greedy_reference(prompt)
    stop_tok = toks[2]
    first = toks.index(stop_tok)
    # With ignore_eos, EOS neither stops nor is masked: the greedy tokens stay as they were.
    eng = engine(config(eos_token_ids=[stop_tok]))
    free = eng.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True, min_tokens=8))[0]
    assert free.output_token_ids == toks
    held = engine(config()).generate([prompt], SamplingParams(
        max_tokens=12, min_tokens=first + 1, stop_token_ids=(stop_tok,)))[0]
    assert stop_tok not in held.output_token_ids[:first + 1]
    assert held.output_token_ids[:first] == toks[:first]


class EosExecutor:
    """A rank that ignores min_tokens and answers EOS (token 1) every step."""

    num_blocks, num_sms, kernel_name, compiled = 64, 1, "torch", False

    def step(self, step):
        return StepOutput(token_ids=np.ones(step.plan.num_reqs, np.int32), step_id=step.step_id)


def test_engine_stops_only_after_min_tokens():
    """The finish rule holds on the driver too: a stop token counts only once min_tokens are out
    (vLLM's check_stop), whatever the rank drew."""
    cfg = config(eos_token_ids=[1]).model_copy(update={"async_scheduling": False})
    eng = LLMEngine(cfg, EosExecutor())
    outs = eng.generate([[5, 6, 7]] * 3, [SamplingParams(max_tokens=8, min_tokens=m) for m in (0, 3, 8)])
    assert [o.output_token_ids for o in outs] == [[1], [1] * 4, [1] * 8]
    assert [o.finish_reason for o in outs] == ["stop", "stop", "length"]


def test_seeded_tokens_ignore_batch_mix_and_step_split():
    """A seeded, filtered, penalised request draws the same tokens alone, in a mixed batch, with
    a small token budget (chunked prefill: other steps), and under async scheduling."""
    prompts, params = workload(), mixed_params()
    target = 2
    alone = engine(config()).generate([prompts[target]], params[target])[0]
    mixed = engine(config()).generate(prompts, params)[target]
    small = config().model_copy(update={"max_num_batched_tokens": 24})
    split = engine(small, asyn=True).generate(prompts, params)[target]
    assert alone.output_token_ids == mixed.output_token_ids == split.output_token_ids
    for o in (mixed, split):
        got = np.array([t.logprob for t in o.logprobs])
        assert np.allclose(got, [t.logprob for t in alone.logprobs], atol=1e-5)


def check_each_token_against_reference(eng, eos=()):
    """From now on every step returns the rank's raw logits, and each sampled token is checked
    on the driver against the float64 reference applied to those logits and the request's
    history: greedy rows take the reference's argmax, hot rows draw inside its support, and
    logprobs are log_softmax(raw logits).  Returns the counts of checks made."""
    made = {"greedy": 0, "moved": 0, "hot": 0, "logprobs": 0}
    ex, apply = eng.executor, eng._apply

    def step(step_in):
        step_in.return_logits = step_in.plan is not None
        return type(ex).step(ex, step_in)

    def checked(done, out):
        rows = [] if out.logprobs is None else out.logprobs.rows.tolist()
        for row, (req, sampled) in enumerate(zip(done.reqs, done.samples)):
            if not sampled or req.finished:
                continue
            raw, tok, p = out.logits[row], int(out.token_ids[row]), req.params
            # before this token is applied: the history it was drawn with
            want = ref.raw_process(raw, req.prompt_token_ids, req.output_token_ids, p, eos)
            if p.temperature == 0:
                top2 = np.sort(want)[-2:]
                if top2[1] - top2[0] > 1e-4:
                    assert tok == want.argmax(), (req.request_id, len(req.output_token_ids))
                    made["greedy"] += 1
                    made["moved"] += int(tok != raw.argmax())  # the processing changed the token
            else:
                support, ambiguous = ref.hot_process(want, p)
                if not ambiguous:
                    assert np.isfinite(support[tok]), (req.request_id, len(req.output_token_ids))
                    made["hot"] += 1
            if p.logprobs is not None:
                j = rows.index(row)
                lp = ref.log_softmax(raw)
                assert abs(out.logprobs.logprobs[j, 0] - lp[tok]) < 1e-5
                assert out.logprobs.selected_token_ranks[j] == (lp >= lp[tok]).sum()  # ties count (vLLM; bf16 ties often)
                made["logprobs"] += 1
        return apply(done, out)

    ex.step, eng._apply = step, checked
    return made


@pytest.mark.parametrize("asyn", [False, True])
def test_penalties_follow_the_reference_step_by_step(asyn):
    """Under async scheduling a decode row's newest token is still on the rank when the next step
    is planned: the rank fills it into the penalty history from the previous step's tokens."""
    prompts, params = workload(), mixed_params(12)
    eos = (7,)
    eng = engine(config(eos_token_ids=list(eos)), asyn)
    made = check_each_token_against_reference(eng, eos)
    outs = eng.generate(prompts, params)
    assert made["greedy"] >= 30 and made["hot"] >= 20 and made["logprobs"] >= 30, made
    assert made["moved"] >= 3, made  # else the reference check would not see the penalties
    plain = engine(config(eos_token_ids=list(eos))).generate(
        prompts, [SamplingParams(max_tokens=12)] * len(prompts))
    assert outs[3].output_token_ids == plain[3].output_token_ids
    assert sum(outs[i].output_token_ids != plain[i].output_token_ids for i in (0, 1, 6)) >= 1


def test_async_equals_sync_with_penalties_and_logprobs():
    prompts, params = workload(), mixed_params(14)
    sync = engine(config()).generate(prompts, params)
    eng = engine(config(), asyn=True)
    asyn = eng.generate(prompts, params)
    assert [o.output_token_ids for o in asyn] == [o.output_token_ids for o in sync]
    assert [o.finish_reason for o in asyn] == [o.finish_reason for o in sync]
    for a, s in zip(asyn, sync):
        assert (a.logprobs is None) == (s.logprobs is None)
        if a.logprobs is not None:
            assert [(t.token_id, t.rank, [i for i, _ in t.top]) for t in a.logprobs] == \
                   [(t.token_id, t.rank, [i for i, _ in t.top]) for t in s.logprobs]
            assert np.allclose([t.logprob for t in a.logprobs], [t.logprob for t in s.logprobs], atol=1e-5)
    assert eng.planner.stats()["num_used_blocks"] == 0


@pytest.mark.parametrize("asyn", [False, True])
def test_logprobs_align_with_tokens_step_by_step_and_at_the_end(asyn):
    eng = engine(config(), asyn)
    params = [SamplingParams(max_tokens=6, logprobs=4), SamplingParams(max_tokens=6),
              SamplingParams(max_tokens=5, temperature=1.0, seed=1, logprobs=0)]
    ids = [eng.add_request(p, sp) for p, sp in zip(workload()[:3], params)]
    streamed = {i: [] for i in ids}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id == ids[1]:
                assert o.new_logprobs is None and o.logprobs is None
                continue
            assert len(o.new_logprobs) == len(o.new_token_ids) == 1
            assert o.new_logprobs[0].token_id == o.new_token_ids[0]
            streamed[o.request_id] += o.new_logprobs
            assert len(o.logprobs) == len(o.output_token_ids)
    for rid, sp in zip(ids, params):
        out = eng.output(rid)
        if sp.logprobs is None:
            assert out.logprobs is None
            continue
        assert out.logprobs == streamed[rid] and len(out.logprobs) == len(out.output_token_ids)
        for t, tok in zip(out.logprobs, out.output_token_ids):
            assert t.token_id == tok and t.rank >= 1 and t.logprob <= 0 and len(t.top) == sp.logprobs
            assert [lp for _, lp in t.top] == sorted((lp for _, lp in t.top), reverse=True)
            if t.rank == 1 and t.top:
                assert t.top[0][0] == tok


def test_stop_token_ids_outside_the_vocabulary_are_refused():
    eng = engine(config())
    with pytest.raises(ValueError, match=r"stop_token_ids: token id 384 is outside the vocabulary"):
        eng.add_request([1, 2], SamplingParams(stop_token_ids=(3, 384)))
    assert not eng.has_unfinished_requests()


@pytest.mark.slow
def test_tp2_over_ray_matches_in_process(ray_local):
    """TP=2 ranks with async scheduling: penalties, filters, seeds and logprobs as in one process."""
    prompts, params = workload(n=4)[:4], mixed_params(8)[:4]
    single = engine(config()).generate(prompts, params)
    eng = LLMEngine(config(2).model_copy(update={"async_scheduling": True}))
    try:
        dist = eng.generate(prompts, params)
    finally:
        eng.shutdown()
    assert [o.output_token_ids for o in dist] == [o.output_token_ids for o in single]
    for d, s in zip(dist, single):
        if s.logprobs is not None:
            assert np.allclose([t.logprob for t in d.logprobs], [t.logprob for t in s.logprobs], atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", ["auto", "off"])
def test_on_gpu_async_with_graphs_follows_reference_and_sync(graphs):
    """On CUDA: decode steps replay graphs that end at the hidden states, and sampling (with the
    penalty histories' placeholders filled on the device, and logprobs in the pinned deferred
    copy) runs after them.  Each token against the float64 reference, and async == sync."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    base = config(dtype="bfloat16", eos_token_ids=[7])
    cfg = base.model_copy(update={"parallel": base.parallel.model_copy(
        update={"device": "cuda", "cuda_graphs": graphs})})
    prompts, params = workload(), mixed_params(12)
    eng = engine(cfg, asyn=True)
    made = check_each_token_against_reference(eng, (7,))
    outs = eng.generate(prompts, params)
    assert made["greedy"] >= 30 and made["hot"] >= 20 and made["logprobs"] >= 30, made
    assert (eng.executor.worker.graphs is not None) == (graphs == "auto")
    sync = engine(cfg).generate(prompts, params)
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in sync]
    for a, s in zip(outs, sync):
        if s.logprobs is not None:
            assert np.allclose([t.logprob for t in a.logprobs], [t.logprob for t in s.logprobs], atol=1e-5)


@pytest.mark.parametrize("asyn", [False, True])
def test_logit_bias_forces_and_bans_through_the_engine(asyn):
    """logit_bias travels with the params to the rank: +100 at temperature 0 emits that token every
    step, -100 on the unbiased greedy token never emits it, and an unbiased request batched with
    them is the plain greedy output."""
    prompts = workload()[:3]
    plain = engine(config()).generate(prompts, [SamplingParams(max_tokens=8)] * 3)
    banned = sorted(set(plain[1].output_token_ids))
    params = [SamplingParams(max_tokens=8, logit_bias={42: 100.0}),
              SamplingParams(max_tokens=8, logit_bias={t: -100.0 for t in banned}),
              SamplingParams(max_tokens=8)]
    outs = engine(config(), asyn).generate(prompts, params)
    assert outs[0].output_token_ids == [42] * 8
    assert not set(outs[1].output_token_ids) & set(banned)
    assert outs[2].output_token_ids == plain[2].output_token_ids


def test_logit_bias_outside_the_vocabulary_is_refused():
    eng = engine(config())
    with pytest.raises(ValueError, match=r"logit_bias: token id 384 is outside the vocabulary"):
        eng.add_request([1, 2], SamplingParams(logit_bias={384: 1.0}))
    assert not eng.has_unfinished_requests()


def test_num_cached_tokens_is_the_prompts_prefix_cache_hit():
    """The engine reports per request how many prompt tokens came from the prefix cache (the
    OpenAI usage's cached_tokens): none the first time, the full blocks of the prompt after."""
    cfg = config()
    eng = engine(cfg)
    bs = cfg.cache.block_size
    prompt = workload()[0]
    assert len(prompt) > bs
    first = eng.generate([prompt], SamplingParams(max_tokens=3))[0]
    again = eng.generate([prompt + [5]], SamplingParams(max_tokens=3))[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == len(prompt) // bs * bs > 0
    streamed = []
    rid = eng.add_request(prompt, SamplingParams(max_tokens=2))
    while eng.has_unfinished_requests():
        streamed += [o.num_cached_tokens for o in eng.step() if o.request_id == rid]
    assert streamed and set(streamed) == {again.num_cached_tokens}
