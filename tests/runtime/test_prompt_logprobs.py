"""vLLM's ``prompt_logprobs`` through the engine (in-process rank on CPU): each prompt token's
logprob against a teacher-forced float64 log-softmax of the same weights in HF transformers,
across chunked prefill, async scheduling, preemption and the prefix cache.

Tolerance: 2e-5 absolute on a logprob.  The rank runs float32 (one summation order per matmul,
the paged torch kernel); the reference runs the same weights in float64, so only float32
rounding over 3 layers separates them (measured ~2e-6).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ray_attn.engine import LLMEngine, SamplingParams
from ray_attn.model.registry import save_random_checkpoint
from ray_attn.runtime import InProcessExecutor
from tests.runtime.test_engine_tp import config, workload

TOL = 2e-5


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """prompt -> float64 log-softmax [len, vocab] of HF's model with the engine's weights."""
    import transformers

    cfg = config()
    folder = tmp_path_factory.mktemp("ckpt")
    save_random_checkpoint(cfg.model, str(folder), seed=cfg.model.seed)
    hf = getattr(transformers, cfg.model.architecture).from_pretrained(
        str(folder), attn_implementation="eager", dtype=torch.float64).eval()

    def logprobs(prompt):
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([prompt])).logits[0], -1).numpy()

    logprobs.folder = str(folder)  # random weights drawn on a GPU differ: it loads these
    return logprobs


def engine(asyn=False, **kw):
    cfg = config(**kw).model_copy(update={"async_scheduling": asyn})
    return LLMEngine(cfg, InProcessExecutor(cfg))


def check(prompt, got, want, k):
    """``got`` (RequestOutput.prompt_logprobs) against the reference ``want`` [len, vocab]."""
    assert len(got) == len(prompt) and got[0] is None
    for j, e in enumerate(got[1:], 1):
        row = want[j - 1]  # the logits at position j - 1 predict token j
        assert e.token_id == prompt[j]
        assert abs(e.logprob - row[prompt[j]]) < TOL, (j, e.logprob, row[prompt[j]])
        t = row[prompt[j]]  # its rank counts the tokens at least as likely, itself included
        assert 1 + (row > t + TOL).sum() <= e.rank <= (row >= t - TOL).sum(), (j, e.rank)
        order = np.argsort(-row)[:k]
        assert [i for i, _ in e.top] == order.tolist(), j
        np.testing.assert_allclose([v for _, v in e.top], row[order], atol=TOL)


@pytest.mark.parametrize("asyn", [False, True])
@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_match_float64_teacher_forcing(reference, asyn, k):
    """Seven prompts, one longer than the token budget (its prefill runs in chunks), with plain
    requests between them: every prompt position once, in order, right."""
    prompts = workload()
    params = [SamplingParams(max_tokens=3, prompt_logprobs=k if i % 2 == 0 else None,
                             logprobs=1 if i % 3 == 0 else None) for i in range(len(prompts))]
    eng = engine(asyn)
    outs = eng.generate(prompts, params)
    for p, sp, o in zip(prompts, params, outs):
        if sp.prompt_logprobs is None:
            assert o.prompt_logprobs is None
        else:
            check(p, o.prompt_logprobs, reference(p), k)
    assert len(prompts[-1]) > eng.config.max_num_batched_tokens  # the chunked case is in there


def test_prompt_logprobs_skip_the_prefix_cache_and_leave_it_to_the_others(reference):
    """A request that asks computes its whole prompt even when the cache holds it; a plain request
    after it still hits the blocks the first one cached."""
    prompt = workload()[0]
    eng = engine()
    first = eng.generate([prompt], SamplingParams(max_tokens=2))[0]
    asks = eng.generate([prompt], SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    plain = eng.generate([prompt], SamplingParams(max_tokens=2))[0]
    assert first.num_cached_tokens == 0 and asks.num_cached_tokens == 0
    assert plain.num_cached_tokens >= 32
    check(prompt, asks.prompt_logprobs, reference(prompt), 1)
    # the n samples of one prompt, admitted in one step: the plain one may hit the asking one's blocks
    both = eng.generate([prompt, prompt], [SamplingParams(max_tokens=2, prompt_logprobs=0),
                                           SamplingParams(max_tokens=2)])
    check(prompt, both[0].prompt_logprobs, reference(prompt), 0)
    assert both[0].output_token_ids == both[1].output_token_ids == plain.output_token_ids


def test_prompt_logprobs_survive_preemption(reference):
    """A pool too small for the batch preempts (recomputes) requests mid-prompt and mid-decode;
    each prompt position is still answered once, and right."""
    prompts = workload()[:6]
    eng = engine(num_blocks=14)
    outs = eng.generate(prompts, SamplingParams(max_tokens=20, prompt_logprobs=2))
    assert eng.stats.preemptions > 0
    for p, o in zip(prompts, outs):
        check(p, o.prompt_logprobs, reference(p), 2)


def test_the_first_token_output_carries_them_once():
    """Streaming callers get the prompt's logprobs on the first token's output, and only there."""
    eng = engine()
    rid = eng.add_request(workload()[1], SamplingParams(max_tokens=4, prompt_logprobs=0))
    seen = []
    while eng.has_unfinished_requests():
        seen += [o for o in eng.step() if o.request_id == rid]
    carrying = [i for i, o in enumerate(seen) if o.prompt_logprobs is not None]
    assert carrying[0] == 0 and len(seen[0].prompt_logprobs) == len(workload()[1])
    assert carrying == [0, len(seen) - 1]  # and the final output, which holds everything


@pytest.mark.parametrize("bad", [-1, 21, 2.5])
def test_prompt_logprobs_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 2e-4), ("bfloat16", 0.15)])
@pytest.mark.parametrize("asyn", [False, True])
def test_prompt_logprobs_on_the_gpu(reference, dtype, tol, asyn):
    """On CUDA, where async scheduling answers a step one step late and its prompt logprobs
    travel in a pinned copy of their own.  bfloat16's tolerance is its rounding over 3 layers
    (a target one position off would miss by ~1-3 nats)."""
    cfg = config(dtype=dtype)
    cfg = cfg.model_copy(update={"async_scheduling": asyn, "checkpoint": reference.folder,
                                 "parallel": cfg.parallel.model_copy(update={"device": "cuda"})})
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    prompts = workload()
    outs = eng.generate(prompts, SamplingParams(max_tokens=4, prompt_logprobs=2))
    for p, o in zip(prompts, outs):
        want = reference(p)
        got = np.array([e.logprob for e in o.prompt_logprobs[1:]])
        np.testing.assert_allclose(got, want[np.arange(len(p) - 1), p[1:]], atol=tol)
        assert [e.token_id for e in o.prompt_logprobs[1:]] == p[1:]
