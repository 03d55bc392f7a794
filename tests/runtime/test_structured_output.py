"""Structured outputs in the engine (in-process rank): the device bitmask against a float64 numpy
reference, grammars honoured with sync and async scheduling alike, and under async scheduling a
constrained row sitting out the step after each of its own while the other rows run every step."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ray_attn.engine import LLMEngine, SamplingParams
from ray_attn.runtime import InProcessExecutor
from ray_attn.runtime.logits_processors import apply_token_bitmask
from ray_attn.structured_output import GrammarCompiler, StructuredOutputsParams
from tests.runtime.test_engine_tp import config
from tests.tokenizer_fixture import EOS_ID, build_tokenizer

VOCAB = 384
SCHEMA = {"type": "object", "properties": {"name": {"enum": ["fox", "dog"]}, "n": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 99}},
          "required": ["name", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d, VOCAB)
    return AutoTokenizer.from_pretrained(str(d), local_files_only=True)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("V", [31, 32, 384, 1000])
def test_bitmask_masks_exactly_the_clear_bits(device, V, rng):
    G, W = 5, (V + 31) // 32
    allowed = torch.rand(G, V, generator=rng) < 0.3
    words = np.zeros((G, W), np.int64)
    for g, i in zip(*np.nonzero(allowed.numpy())):
        words[g, i // 32] |= 1 << (i % 32)
    bitmask = torch.from_numpy(words.astype(np.uint32).view(np.int32)).to(device)  # bit 31 is the sign
    logits = torch.randn(G, V, generator=rng, dtype=torch.float64).float().to(device)
    got = apply_token_bitmask(logits, bitmask).cpu().double().numpy()
    want = np.where(allowed.numpy(), logits.cpu().double().numpy(), -np.inf)
    np.testing.assert_array_equal(got, want)


def engine(tok, asyn):
    cfg = config(eos_token_ids=[EOS_ID]).model_copy(update={"async_scheduling": asyn})
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    eng.grammar_compiler = GrammarCompiler(tok, VOCAB, [EOS_ID])
    return eng


SPECS = [StructuredOutputsParams(json=json.dumps(SCHEMA)), StructuredOutputsParams(regex=r"[a-c]{3}-\d\d"),
         StructuredOutputsParams(choice=("yes", "no", "maybe"))]


def check(tok, spec, ids):
    import re

    text = tok.decode(ids, skip_special_tokens=True)
    if spec.json is not None:
        obj = json.loads(text)
        assert obj["name"] in ("fox", "dog") and 0 <= obj["n"] <= 99 and set(obj) == {"name", "n"}
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    else:
        assert text in spec.choice


def test_grammars_hold_and_async_gives_what_sync_gives(tok):
    prompt = tok("hello world")["input_ids"]
    params = [SamplingParams(max_tokens=48, structured_outputs=s, temperature=t, seed=i)
              for i, (s, t) in enumerate((s, t) for t in (0.0, 1.0) for s in SPECS)]
    outs = {a: engine(tok, a).generate([prompt] * len(params), params) for a in (False, True)}
    for sp, o, oa in zip(params, outs[False], outs[True]):
        assert o.finish_reason == "stop" and o.output_token_ids[-1] == EOS_ID
        check(tok, sp.structured_outputs, o.output_token_ids)
        assert oa.output_token_ids == o.output_token_ids


def test_async_a_constrained_row_waits_for_its_token_and_no_other_row_does(tok):
    eng = engine(tok, True)
    prompt = tok("hello world")["input_ids"]
    plain = eng.add_request(prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    bound = eng.add_request(prompt, SamplingParams(max_tokens=20, structured_outputs=SPECS[1]))
    seen = {plain: [], bound: []}
    steps = 0
    while eng.has_unfinished_requests():
        outs = eng.step()
        steps += 1
        for o in outs:
            seen[o.request_id].append(steps)
    gaps = np.diff(seen[plain])
    assert (gaps == 1).all(), "the plain row must get a token every step"
    assert (np.diff(seen[bound]) >= 2).all(), "the constrained row runs only once its token is back"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_apply_grammar_masks_just_the_constrained_rows(device, rng):
    """The sampler's path: the constrained rows masked exactly, every other row untouched."""
    from ray_attn.runtime.sampling import SamplingTensors, apply_grammar

    B, V, rows = 6, 1000, np.array([1, 4], np.int32)
    W = (V + 31) // 32
    allowed = torch.rand(len(rows), V, generator=rng) < 0.2
    words = np.zeros((len(rows), W), np.int64)
    for g, i in zip(*np.nonzero(allowed.numpy())):
        words[g, i // 32] |= 1 << (i % 32)
    st = SamplingTensors(grammar_rows=torch.from_numpy(rows).long().to(device),
                         grammar_bitmask=torch.from_numpy(words.astype(np.uint32).view(np.int32)).to(device))
    logits = torch.randn(B, V, generator=rng).to(device)
    out = logits.clone()
    apply_grammar(out, st)
    want = logits.cpu().numpy().copy()
    want[rows] = np.where(allowed.numpy(), want[rows], -np.inf)
    np.testing.assert_array_equal(out.cpu().numpy(), want)
