"""SamplingParams' checks, and the batched device pipeline (the driver's ``build_sampling_inputs``,
staged through ``StepBuffers``, then ``sample_on_device``) against the float64 reference in
``sampling_reference``: penalties, min_tokens, min-p/top-k/top-p support sets, seeded draws'
frequencies, raw logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_attn.request import PLACEHOLDER, Request, SamplingParams
from ray_attn.runtime.buffers import StepBuffers
from ray_attn.runtime.sampling import (
    SamplingTensors,
    apply_hot_processors,
    apply_raw_processors,
    sample_on_device,
)
from ray_attn.sampling_inputs import build_sampling_inputs
from tests.runtime import sampling_reference as ref

V = 256
EOS = (11,)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_tokens=0), r"max_tokens must be >= 1, got 0"),
    (dict(max_tokens=2.5), r"max_tokens must be an integer, got 2.5"),
    (dict(temperature=-0.1), r"temperature must be >= 0, got -0.1"),
    (dict(temperature=float("nan")), r"temperature must be a finite number"),
    (dict(top_p=0), r"top_p must be in \(0, 1\], got 0"),
    (dict(top_p=1.01), r"top_p must be in \(0, 1\], got 1.01"),
    (dict(top_k=-2), r"top_k must be 0 or -1 \(off\), or in \[1, 2\*\*31\), got -2"),
    (dict(top_k=True), r"top_k must be an integer, got True"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\], got 1.5"),
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\], got 2.5"),
    (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\], got -3"),
    (dict(repetition_penalty=0), r"repetition_penalty must be > 0, got 0"),
    (dict(seed=-1), r"seed must be in \[0, 2\*\*63\), got -1"),
    (dict(stop_token_ids=(1, -3)), r"stop_token_ids must be token ids >= 0"),
    (dict(stop_token_ids="ab"), r"stop_token_ids must be a sequence of token ids"),
    (dict(max_tokens=4, min_tokens=5), r"min_tokens must be in \[0, max_tokens=4\], got 5"),
    (dict(ignore_eos=1), r"ignore_eos must be a bool, got 1"),
    (dict(logprobs=21), r"logprobs must be None or in \[0, 20\], got 21"),
    (dict(logprobs=-1), r"logprobs must be None or in \[0, 20\], got -1"),
    (dict(logit_bias={3: 100.5}), r"logit_bias: bias 100.5 of token 3 is outside \[-100, 100\]"),
    (dict(logit_bias={-1: 1.0}), r"logit_bias: token id -1 is not >= 0"),
    (dict(logit_bias={1: float("nan")}), r"logit_bias must be a finite number"),
    (dict(logit_bias=[(1, 1.0), (1, 2.0)]), r"logit_bias: token id 1 appears twice"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), r"logit_bias: 301 entries exceeds the limit of 300"),
    (dict(logit_bias="ab"), r"logit_bias must map token ids to biases"),
])
def test_params_refuse_bad_values_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_params_normalise_as_vllm():
    assert SamplingParams(temperature=0.5, top_k=-1).top_k == 0
    greedy = SamplingParams(temperature=0, top_k=5, top_p=0.5, min_p=0.2)
    assert (greedy.top_k, greedy.top_p, greedy.min_p) == (0, 1.0, 0.0) and greedy.plain
    assert SamplingParams(temperature=1e-4).temperature == 1e-2
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert not SamplingParams(logprobs=0).plain and not SamplingParams(repetition_penalty=1.1).plain


CASES = {
    "presence": dict(presence_penalty=1.5),
    "presence_negative": dict(presence_penalty=-1.0, temperature=0.8),
    "frequency": dict(frequency_penalty=0.7),
    "repetition_up": dict(repetition_penalty=1.8),
    "repetition_down": dict(repetition_penalty=0.6, temperature=1.1),
    "min_tokens": dict(min_tokens=6, stop_token_ids=(3, 9)),
    "min_tokens_ignore_eos": dict(min_tokens=6, stop_token_ids=(3,), ignore_eos=True),
    "top_k": dict(temperature=0.7, top_k=7),
    "top_p": dict(temperature=1.3, top_p=0.6),
    "top_k_top_p": dict(temperature=0.9, top_k=20, top_p=0.8),
    "top_k_beyond_vocab": dict(temperature=1.0, top_k=1000),  # clamped to the vocabulary
    "top_k_beyond_vocab_top_p": dict(temperature=1.0, top_k=1000, top_p=0.7),
    "min_p": dict(temperature=1.0, min_p=0.1),
    "logit_bias": dict(logit_bias={3: 4.0, 9: -100.0, 17: 2.5, 200: -1.5}),
    "logit_bias_hot": dict(temperature=0.9, top_k=20, logit_bias={3: 6.0, 5: 100.0, 40: -3.0}),
    "everything": dict(temperature=0.8, top_k=30, top_p=0.9, min_p=0.05, presence_penalty=0.5,
                       frequency_penalty=0.4, repetition_penalty=1.3, min_tokens=4, stop_token_ids=(5,),
                       logit_bias={5: 3.0, 7: -2.0, 12: 1.0}),
}
OTHER = dict(temperature=0.6, top_k=3, repetition_penalty=1.2)  # a different row in the same batch


def make_batch(rng, case: dict, n=12, samples_all=True):
    """Rows alternate: the case's params (seeded, unseeded), a plain greedy row, a plain hot row,
    another processed row.  Outputs repeat a few tokens (counts > 1) and include EOS and stop ids;
    row 0's last token is still out (a placeholder that ``last_tokens[5]`` fills)."""
    reqs, truth, last_tokens = [], [], torch.from_numpy(rng.integers(0, V, 8).astype(np.int32))
    kinds = [dict(case, seed=1), dict(case), dict(), dict(temperature=1.0, seed=4), dict(OTHER, seed=2)]
    for i in range(n):
        kw = dict(kinds[i % len(kinds)], max_tokens=64)
        if "seed" in kw:
            kw["seed"] += i
        prompt = rng.integers(0, V, int(rng.integers(3, 30))).tolist()
        output = rng.choice(np.r_[rng.integers(0, V, 6), [3, 5, 9, EOS[0]]], int(rng.integers(0, 12))).tolist()
        params = SamplingParams(**kw, logprobs=int(i % 4) if i % 3 else None)
        r = Request(f"r{i}", prompt + output, len(prompt), params)
        if i == 0:  # the previous step's token, still on the rank
            r.token_ids.append(PLACEHOLDER)
            r.pending, r.sampled_row = 1, 5
            output = output + [int(last_tokens[5])]
        reqs.append(r)
        truth.append((prompt, output))
    samples = [samples_all or i % 5 != 1 for i in range(n)]
    return reqs, truth, samples, last_tokens


def run_pipeline(reqs, samples, logits32: np.ndarray, device, last_tokens, generator=None):
    """What a step does with these requests: the engine's arrays, staged as the worker stages
    them, then the device pipeline; everything brought back as float64/int numpy."""
    temps = np.array([r.params.temperature for r in reqs], np.float32)
    seeds = np.array([-1 if r.params.seed is None else r.params.seed for r in reqs], np.int64)
    idx = np.array([len(r.token_ids) - r.num_prompt_tokens for r in reqs], np.int32)
    si = build_sampling_inputs(reqs, samples, idx, frozenset(EOS), V)
    bufs = StepBuffers(device)
    bufs.begin()
    st = SamplingTensors.stage(temps, seeds, idx, torch.device(device), bufs.put, si)
    bufs.end()
    raw = torch.from_numpy(logits32).to(device)
    last = last_tokens.to(device)
    processed = apply_raw_processors(raw, st, last)
    hot = None if st.rows is None else apply_hot_processors(processed, st).double().cpu().numpy()
    tokens, lp = sample_on_device(raw, st, generator, last)
    assert torch.equal(raw.cpu(), torch.from_numpy(logits32)), "the raw logits must stay raw"
    return (st, processed.double().cpu().numpy(), hot, tokens.cpu().numpy(),
            None if lp is None else lp.to_numpy())


def check_against_reference(device, case_name, seed=0):
    rng = np.random.default_rng(seed)
    reqs, truth, samples, last = make_batch(rng, CASES[case_name])
    logits = (rng.standard_normal((len(reqs), V)) * 2).astype(np.float32)
    st, processed, hot, tokens, lp = run_pipeline(reqs, samples, logits, device, last,
                                                  torch.Generator(device).manual_seed(0))
    hot_rows = [] if st.rows is None else st.rows.cpu().tolist()
    ambiguous = 0
    for i, (r, (prompt, output)) in enumerate(zip(reqs, truth)):
        want = ref.raw_process(logits[i], prompt, output, r.params, EOS)
        fin = np.isfinite(want)
        assert np.array_equal(np.isfinite(processed[i]), fin), f"row {i}: masked tokens"
        np.testing.assert_allclose(processed[i][fin], want[fin], rtol=1e-5, atol=1e-5, err_msg=f"row {i}")
        if r.params.temperature == 0:
            top2 = np.sort(want)[-2:]
            if top2[1] - top2[0] > 1e-4:
                assert tokens[i] == want.argmax(), f"row {i}: greedy"
            continue
        support, amb = ref.hot_process(want, r.params)
        if amb:
            ambiguous += 1
            continue
        got = hot[hot_rows.index(i)]
        assert np.array_equal(np.isfinite(got), np.isfinite(support)), f"row {i}: support"
        s = np.isfinite(support)
        np.testing.assert_allclose(got[s], support[s], rtol=1e-5, atol=1e-5, err_msg=f"row {i}")
        assert np.isfinite(support[tokens[i]]), f"row {i}: drew a token outside the support"
    assert ambiguous <= 1, ambiguous
    check_logprobs(reqs, samples, logits, tokens, lp)
    return tokens


def check_logprobs(reqs, samples, logits, tokens, lp):
    """Raw logprobs == float64 log_softmax(raw logits) within 1e-5; the rank and the top k."""
    asked = [i for i, r in enumerate(reqs) if r.params.logprobs is not None and samples[i]]
    if not asked:
        assert lp is None
        return
    assert lp.rows.tolist() == asked
    for j, i in enumerate(asked):
        want = ref.log_softmax(logits[i])
        k = reqs[i].params.logprobs
        assert lp.logprob_token_ids[j, 0] == tokens[i]
        assert abs(lp.logprobs[j, 0] - want[tokens[i]]) < 1e-5
        assert lp.selected_token_ranks[j] == 1 + (want > want[tokens[i]]).sum()
        top = np.argsort(-want, kind="stable")[:k]
        assert lp.logprob_token_ids[j, 1:1 + k].tolist() == top.tolist(), f"row {i}: top ids"
        np.testing.assert_allclose(lp.logprobs[j, 1:1 + k], want[top], atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", sorted(CASES))
def test_pipeline_matches_float64_reference(case, seed):
    check_against_reference("cpu", case, seed)


def test_rows_that_do_not_sample_are_left_out():
    """A prompt chunk's row draws nothing that counts: it sends no history, no mask, no logprobs."""
    rng = np.random.default_rng(5)
    reqs, _, samples, _ = make_batch(rng, CASES["everything"], samples_all=False)
    idx = np.array([len(r.token_ids) - r.num_prompt_tokens for r in reqs], np.int32)
    si = build_sampling_inputs(reqs, samples, idx, frozenset(EOS), V)
    skipped = {i for i, s in enumerate(samples) if not s}
    assert skipped and not skipped & set(si.penalty_rows.tolist())
    assert not skipped & set(si.min_tokens_rows.tolist()) and all(si.logprobs[i] == -1 for i in skipped)
    assert all(si.top_k[i] == 0 for i in skipped)
    plain = [Request("p", [1, 2], 2, SamplingParams(temperature=0.5, seed=1)) for _ in range(3)]
    assert build_sampling_inputs(plain, [True] * 3, np.zeros(3, np.int32), frozenset(EOS), V) is None


def test_all_greedy_plain_batch_stages_nothing():
    st = SamplingTensors.stage(np.zeros(4, np.float32), -np.ones(4, np.int64), np.zeros(4, np.int32),
                               torch.device("cpu"), None, None)
    assert st == SamplingTensors()


def test_history_placeholder_is_filled_from_the_previous_step():
    """The penalty sees the token still out (last_tokens[prev row]), not -1 or another row's."""
    p = SamplingParams(frequency_penalty=2.0, presence_penalty=2.0)
    r = Request("a", [1, 2, 3, PLACEHOLDER], 2, p)
    r.pending, r.sampled_row = 1, 2
    logits = np.zeros((1, 8), np.float32)
    logits[0, 6] = 3.0  # greedy picks 6 unless its penalty (4) applies
    last = torch.tensor([0, 0, 6, 0], dtype=torch.int32)
    _, processed, _, tokens, _ = run_pipeline([r], [True], logits, "cpu", last)
    # 6 (the placeholder's token) and 3 are output tokens once each: 2 x count + 2
    assert processed[0, 6] == pytest.approx(-1.0) and processed[0, 3] == pytest.approx(-4.0)
    assert processed[0, 1] == 0.0  # a prompt token: no presence/frequency penalty
    assert tokens[0] != 6


@pytest.mark.parametrize("params", [
    dict(temperature=0.8, top_k=10, top_p=0.9, min_p=0.02, repetition_penalty=1.3, presence_penalty=0.4),
    dict(temperature=1.5, top_p=0.7),
    dict(temperature=0.6, top_k=6),
])
def test_seeded_draws_follow_the_filtered_distribution(params):
    """Many seeded draws (one token index each) of one row: never outside the support, and
    their frequencies pass a chi-square test against the reference's filtered softmax at
    P(false alarm) ~ 1e-4, with total variation under 0.04."""
    Vs, N, batch = 24, 8000, 500
    rng = np.random.default_rng(7)
    logits = (rng.standard_normal(Vs) * 1.5).astype(np.float32)
    p = SamplingParams(max_tokens=16, seed=99, **params)
    prompt, output = [1, 2, 3], [2, 5]
    want = ref.raw_process(logits, prompt, output, p)
    support, amb = ref.hot_process(want, p)
    assert not amb
    probs = ref.softmax(support)
    counts = np.zeros(Vs)
    for start in range(0, N, batch):
        reqs = []
        for _ in range(batch):
            r = Request("x", prompt + output, len(prompt), p)
            reqs.append(r)
        idx = np.arange(start, start + batch, dtype=np.int32)  # the token index moves the draw
        si = build_sampling_inputs(reqs, [True] * batch, np.full(batch, len(output), np.int32), frozenset(), Vs)
        st = SamplingTensors.stage(np.full(batch, p.temperature, np.float32), np.full(batch, p.seed, np.int64),
                                   idx, torch.device("cpu"), None, si)
        toks, _ = sample_on_device(torch.from_numpy(np.tile(logits, (batch, 1))), st)
        counts += np.bincount(toks.numpy(), minlength=Vs)
    s = probs > 0
    assert counts[~s].sum() == 0, "a draw outside the support"
    chi2 = ((counts[s] - N * probs[s]) ** 2 / (N * probs[s])).sum()
    assert s.sum() > 2 and chi2 < ref.chi2_critical(int(s.sum()) - 1), (chi2, counts, N * probs)
    assert 0.5 * np.abs(counts / N - probs).sum() < 0.04


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_pipeline_on_gpu_matches_float64_reference(case):
    """The same device pipeline on CUDA (pinned staging, non-blocking copies), against the same
    float64 reference; seeded hot rows draw the same tokens as on the CPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    gpu = check_against_reference("cuda", case, 0)
    cpu = check_against_reference("cpu", case, 0)
    rng = np.random.default_rng(0)
    reqs, _, _, _ = make_batch(rng, CASES[case])
    for i, r in enumerate(reqs):
        if r.params.seed is not None:
            assert gpu[i] == cpu[i], f"row {i}: a seeded draw moved between devices"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logit_bias_forces_and_bans_tokens(temperature):
    """+100 makes a token the argmax (and, hot, all but certain); -100 bans the current argmax;
    rows without a bias in the same batch keep their raw logits."""
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal((4, V)) * 2).astype(np.float32)
    top = logits.argmax(axis=1)
    kw = dict(temperature=temperature, seed=7)
    reqs = [Request("a", [1, 2], 2, SamplingParams(**kw, logit_bias={40: 100.0})),
            Request("b", [1, 2], 2, SamplingParams(**kw, logit_bias={int(top[1]): -100.0})),
            Request("c", [1, 2], 2, SamplingParams(temperature=0.0)),
            Request("d", [1, 2], 2, SamplingParams(**kw, logit_bias={int(top[3]): -100.0, 41: 100.0}))]
    st, processed, _, tokens, _ = run_pipeline(reqs, [True] * 4, logits, "cpu", torch.zeros(8, dtype=torch.int32))
    assert st.logit_bias_rows.tolist() == [0, 1, 3, 3]  # only the rows that use it, one op
    assert tokens[0] == 40 and tokens[1] != top[1] and tokens[2] == top[2] and tokens[3] == 41
    np.testing.assert_array_equal(processed[2], logits[2])
    assert processed[1, top[1]] == pytest.approx(logits[1, top[1]] - 100, abs=1e-4)
