"""Speculative decoding with structured outputs: a constrained row's drafts are cut to what its
grammar takes, rank 0 masks each draft position with its matcher advanced through the drafts
before it, and the next step rolls the rejected ones back (runtime/grammars.py).

Rank 0's masks are held to the driver's own matcher walked token by token, for both backends;
through the engine (in-process rank, CPU, float32) constrained rows verify drafts, have some
accepted and some rejected, and give the non-speculative engine's tokens, greedy and seeded."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest

from ray_attn.engine import SamplingParams
from ray_attn.runtime.grammars import RankGrammars
from ray_attn.runtime.messages import SamplingInputs
from ray_attn.structured_output import GrammarCompiler, GrammarSync, StructuredOutputsParams, fill_bitmask
from tests.runtime.test_structured_output import byte_compiler
from tests.spec.test_spec_engine import MODEL, engine, looping_prompt, tokens

BACKENDS = ["xgrammar", "guidance"]
# "a", "b", "c", "-" are ids 0-3, the stop 4 (tests/runtime/test_structured_output.byte_compiler)
A, B, C, DASH, STOP = 0, 1, 2, 3, 4


def allowed(mask_row: np.ndarray, V: int) -> list[int]:
    return np.flatnonzero(np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:V]).tolist()


class Row:
    """One constrained request as GrammarSync and RankGrammars see it, over the byte vocabulary."""

    def __init__(self, compiler, spec, prompt=(5, 6)):
        self.driver = compiler.matcher(compiler.compile(spec), spec)
        self.prompt, self.out = list(prompt), []

    def req(self, drafts=()):
        return SimpleNamespace(request_id="r", grammar=self.driver, token_ids=self.prompt + self.out + list(drafts),
                               num_prompt_tokens=len(self.prompt), num_drafts=len(drafts),
                               output_token_ids=self.out + list(drafts))


def step(sync, row: Row, last: int, drafts=()):
    """A step whose one request computes ``last`` (its newest token) and verifies ``drafts``: a
    logits row at each of its 1 + k positions, the j-th after j drafts."""
    k = len(drafts)
    si = SamplingInputs()
    W = len(row.out)
    sync.fill(si, list(range(k + 1)), [row.req(drafts)] * (k + 1), [W + j for j in range(k + 1)])
    plan = SimpleNamespace(attn=SimpleNamespace(query_start_loc=np.array([0, k + 1], np.int32)),
                           input_token_ids=np.array([last, *drafts], np.int32))
    spec = SimpleNamespace(logits_indices=np.arange(k + 1, dtype=np.int32)) if k else None
    return SimpleNamespace(plan=plan, sampling=si, prev_token_index=None, spec=spec)


def driver_mask_after(row: Row, tokens) -> list[int]:
    """The driver's allowed ids after it takes ``tokens`` (then it forgets them again)."""
    n = 0
    for t in tokens:
        assert row.driver.try_accept(t)
        n += 1
    got = allowed(fill_bitmask([row.driver])[0], row.driver.words * 32)
    row.driver.rollback(n)
    return got


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_draft_position_is_masked_after_the_drafts_before_it_and_rejected_ones_roll_back(backend):
    compiler = byte_compiler(backend)
    V = compiler.vocab_size
    spec = StructuredOutputsParams(regex="(ab-|abc)+c")  # after "ab": "-" or "c"
    row, sync, rank = Row(compiler, spec), GrammarSync(), RankGrammars(V)
    # the driver keeps only the drafts its grammar takes: after "a", "b" then "-", not "a"
    assert row.driver.accept(A)
    row.out.append(A)
    assert row.driver.accepts([B, DASH, A, A]) == 3 and row.driver.accepts([A]) == 0
    assert allowed(fill_bitmask([row.driver])[0], V) == [B]  # accepts() left the state where it was
    drafts = [B, DASH, A]
    masks = rank.bitmask(step(sync, row, A, drafts), None)
    assert [allowed(m, V) for m in masks] == [driver_mask_after(row, drafts[:j]) for j in range(4)]
    assert [allowed(m, V) for m in masks] == [[B], [C, DASH], [A, C], [B]]
    # the target kept "b", then said "c" for the "-": 2 new output tokens, "abc"
    for t in (B, C):
        assert row.driver.accept(t)
    row.out += [B, C]
    drafts = [C, STOP]  # the plain step's rollback of "-" and "a", then two drafts
    masks = rank.bitmask(step(sync, row, C, drafts), None)
    assert [allowed(m, V) for m in masks[:2]] == [driver_mask_after(row, drafts[:j]) for j in range(2)]
    assert [allowed(m, V) for m in masks[:2]] == [[A, C], [STOP]]
    assert (masks[2] == -1).all()  # after the stop the grammar is complete: the row allows anything
    # every draft rejected: the target's own "a" right after the newest token
    assert row.driver.accept(A)
    row.out.append(A)
    (mask,) = rank.bitmask(step(sync, row, A), None)
    assert allowed(mask, V) == allowed(fill_bitmask([row.driver])[0], V) == [B]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_refused_draft_ends_the_rows_of_its_step_and_the_next_step_resumes_in_order(backend):
    """A draft the grammar refuses (the driver never sends one; rank 0 holds anyway): the row
    before it masked it out, the rows after it are never used, and the next step's count is
    what the matcher holds."""
    compiler = byte_compiler(backend)
    V = compiler.vocab_size
    row, sync, rank = Row(compiler, StructuredOutputsParams(regex="(abc)+")), GrammarSync(), RankGrammars(V)
    assert row.driver.accept(A)
    row.out.append(A)
    masks = rank.bitmask(step(sync, row, A, [B, A, C]), None)  # "a" after "ab" is refused
    assert allowed(masks[0], V) == [B] and allowed(masks[1], V) == [C]
    assert B not in allowed(masks[1], V) and A not in allowed(masks[1], V)
    assert (masks[2:] == -1).all()
    assert row.driver.accept(B) and row.driver.accept(C)  # the target said "b", then "c" for the "a"
    row.out += [B, C]
    (mask,) = rank.bitmask(step(sync, row, C), None)
    assert allowed(mask, V) == allowed(fill_bitmask([row.driver])[0], V)
    with pytest.raises(RuntimeError, match="kept 3 of the 0 drafts|taken"):
        row.out += [A, B, C]  # a count the rank cannot reach by rolling back: named, not masked wrong
        rank.bitmask(step(sync, row, C), None)


# ---------------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.tokenizer_fixture import build_tokenizer

    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d, MODEL["vocab_size"])
    return AutoTokenizer.from_pretrained(str(d), local_files_only=True)


ITEMS = {"type": "array", "minItems": 6, "maxItems": 6,
         "items": {"type": "object", "properties": {"name": {"enum": ["fox", "dog"]}},
                   "required": ["name"], "additionalProperties": False}}
SPECS = [StructuredOutputsParams(regex=r"(ab ){30}"), StructuredOutputsParams(json=json.dumps(ITEMS)),
         StructuredOutputsParams(regex=r"(xyz|xy z)+")]


def gpu_engine(spec):
    """The same engine on the GPU in bf16: FlashAttention, CUDA graphs (plain and verifying)."""
    from ray_attn.engine import LLMEngine
    from ray_attn.runtime import InProcessExecutor
    from tests.spec.test_spec_engine import SPEC, config

    cfg = config(SPEC if spec else None)
    cfg = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"device": "cuda"}),
                                 "model": cfg.model.model_copy(update={"dtype": "bfloat16"})})
    return LLMEngine(cfg, InProcessExecutor(cfg))


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def pair(request):
    if request.param == "cuda":
        import torch

        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA GPU")
        return gpu_engine(False), gpu_engine(True)
    return engine(None), engine()


@pytest.mark.parametrize("backend", BACKENDS)
def test_constrained_rows_speculate_and_give_the_non_speculative_tokens(tok, pair, backend):
    import jsonschema

    plain, spec = pair
    for eng in pair:
        eng.grammar_compiler = GrammarCompiler(tok, MODEL["vocab_size"], [2], backend=backend)
    params = [SamplingParams(max_tokens=40, structured_outputs=s, temperature=t, seed=i)
              for i, (s, t) in enumerate((s, t) for t in (0.0, 1.0) for s in SPECS)]
    batch = [looping_prompt(plain)] * len(params) + [looping_prompt(plain)]
    params.append(SamplingParams(max_tokens=40))  # and an unconstrained row beside them
    verified, accept = [], spec.spec.accept  # (request, drafts, drafts accepted) per row a step

    def recording(req, row, layout, emitted):
        if req.grammar is not None and layout.num_drafts[row]:
            verified.append((req.request_id, int(layout.num_drafts[row]), len(emitted) - 1))
        return accept(req, row, layout, emitted)

    spec.spec.accept = recording
    try:
        want, got = plain.generate(batch, params), spec.generate(batch, params)
    finally:
        del spec.spec.accept
    assert tokens(got) == tokens(want)
    for p, o in zip(params[:-1], got):
        text = tok.decode(o.output_token_ids, skip_special_tokens=True)
        s = p.structured_outputs
        if s.json is not None and o.finish_reason == "stop":
            jsonschema.validate(json.loads(text), ITEMS)
        elif s.regex is not None and o.finish_reason == "stop":
            assert re.fullmatch(s.regex, text), text
    assert len({rid for rid, _, _ in verified}) >= 3, verified  # constrained rows speculated ...
    assert sum(a for _, _, a in verified) >= 10, verified  # ... had drafts accepted ...
    assert sum(k - a for _, k, a in verified) >= 3, verified  # ... and rejected
    spec.planner.pool.check_invariants()
    assert spec.planner.num_requests == 0
