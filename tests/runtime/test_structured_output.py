"""Structured outputs in the engine (in-process rank): the device bitmask against a float64 numpy
reference, grammars honoured with sync and async scheduling alike, and under async scheduling a
constrained row sitting out the step after each of its own while the other rows run every step.
Each engine test runs with the ``auto`` backend (xgrammar, and guidance for ``GUIDED``: both
backends in one batch) and with ``guidance`` for every spec; rank 0 rebuilds each matcher from
what ``GrammarSync`` sends (``tests/runtime/test_grammar_backends.py`` walks the grammars alone)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ray_attn.engine import LLMEngine, SamplingParams
from ray_attn.runtime import InProcessExecutor
from ray_attn.runtime.logits_processors import apply_token_bitmask
from ray_attn.structured_output import GrammarCompiler, StructuredOutputsParams
from tests.runtime.test_engine_tp import config
from tests.runtime.test_faults import DyingExecutor
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


BACKENDS = ["auto", "guidance"]


def engine(tok, asyn, thread=False, backend="auto"):
    """An in-process engine; ``thread``: its rank samples a deferred constrained step on a thread
    of its own, as a rank in its own process (a Ray actor) does."""
    cfg = config(eos_token_ids=[EOS_ID]).model_copy(update={"async_scheduling": asyn})
    eng = LLMEngine(cfg, InProcessExecutor(cfg))
    eng.executor.worker.sample_on_thread = thread
    eng.grammar_compiler = GrammarCompiler(tok, VOCAB, [EOS_ID], backend=backend)
    return eng


# Never complete within max_tokens, and each state's mask differs from the one before it: a
# matcher advanced by a wrong token (or by none) masks differently from the driver's.
LONG = StructuredOutputsParams(regex=r"(ab ){200}")
# A maxLength beside a pattern: xgrammar would keep only one of them, so auto compiles it on guidance.
GUIDED_SCHEMA = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 4}},
                 "required": ["code"], "additionalProperties": False}
SPECS = [StructuredOutputsParams(json=json.dumps(SCHEMA)), StructuredOutputsParams(regex=r"[a-c]{3}-\d\d"),
         StructuredOutputsParams(choice=("yes", "no", "maybe")), StructuredOutputsParams(json=json.dumps(GUIDED_SCHEMA))]


def check(tok, spec, ids):
    import re

    import jsonschema

    text = tok.decode(ids, skip_special_tokens=True)
    if spec.json is not None:
        jsonschema.validate(json.loads(text), json.loads(spec.json))
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    else:
        assert text in spec.choice


def test_auto_puts_both_backends_in_one_batch(tok):
    c = GrammarCompiler(tok, VOCAB, [EOS_ID])
    assert [c.compile(s).backend for s in SPECS] == ["xgrammar"] * 3 + ["guidance"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("thread", [False, True])
def test_grammars_hold_and_async_gives_what_sync_gives(tok, thread, backend):
    prompt = tok("hello world")["input_ids"]
    params = [SamplingParams(max_tokens=48, structured_outputs=s, temperature=t, seed=i)
              for i, (s, t) in enumerate((s, t) for t in (0.0, 1.0) for s in SPECS)]
    outs = {a: engine(tok, a, thread, backend).generate([prompt] * len(params), params) for a in (False, True)}
    for sp, o, oa in zip(params, outs[False], outs[True]):
        assert o.finish_reason == "stop" and o.output_token_ids[-1] == EOS_ID
        check(tok, sp.structured_outputs, o.output_token_ids)
        assert oa.output_token_ids == o.output_token_ids


@pytest.mark.parametrize("thread", [False, True])
def test_async_every_row_runs_every_step(tok, thread):
    """Under async scheduling a constrained row's mask for step N+1 is filled on rank 0 from step
    N's token, so it gets a token every step like a plain row, and its grammar still holds."""
    eng = engine(tok, True, thread)
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
    assert (np.diff(seen[plain]) == 1).all(), "the plain row must get a token every step"
    assert (np.diff(seen[bound]) == 1).all(), "the constrained row must get a token every step"
    check(tok, SPECS[1], eng.output(bound).output_token_ids)


class RestartingExecutor(DyingExecutor):
    """Its rank comes back from each death as a fresh one (no matchers, an empty KV cache, the
    same seeded weights), as a restarted Ray actor would."""

    def recover(self) -> float:
        self.worker = self.worker_cls(self.config, 0)
        self.worker.sample_on_thread = False
        self.worker.load_model()
        return 0.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("asyn", [False, True])
@pytest.mark.parametrize("trouble", ["restart", "preempt"])
def test_rank_matchers_survive_restarts_and_preemption(tok, asyn, trouble, backend):
    """A restarted rank gets every matcher again (the driver's GrammarSync is reset), and a
    preempted request's matcher goes on where it was: the same outputs as an untroubled run.
    A re-prefilled row's matcher takes the row's last input token (its newest output), as a
    decode row's does; LONG's masks change with every token, so any other advance shows."""
    prompt = tok("hello world")["input_ids"]
    specs = SPECS + [LONG] * 3  # long outputs: a pool of 6 blocks cannot hold them all
    params = [SamplingParams(max_tokens=40, structured_outputs=sp, temperature=1.0, seed=i)
              for i, sp in enumerate(specs)]
    reference = engine(tok, asyn, backend=backend).generate([prompt] * len(params), params)
    cfg = config(eos_token_ids=[EOS_ID], num_blocks=6 if trouble == "preempt" else 96)
    cfg = cfg.model_copy(update={"async_scheduling": asyn})
    ex = RestartingExecutor(cfg, fail_on={5, 9} if trouble == "restart" else set())
    eng = LLMEngine(cfg, ex)
    eng.grammar_compiler = GrammarCompiler(tok, VOCAB, [EOS_ID], backend=backend)
    outs = eng.generate([prompt] * len(params), params)
    if trouble == "restart":
        assert eng.stats.recoveries == 2
    else:
        assert eng.stats.preemptions > 0
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in reference]
    for sp, o in zip(params, outs):
        if o.finish_reason == "stop":
            check(tok, sp.structured_outputs, o.output_token_ids)
        else:  # cut by max_tokens: a prefix of LONG's one text
            assert o.finish_reason == "length" and sp.structured_outputs is LONG
            assert ("ab " * 200).startswith(tok.decode(o.output_token_ids, skip_special_tokens=True))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("V", [31, 1000, 2 * 4096 + 33])  # the GPU kernel's blocks are 4096 ids
def test_apply_grammar_masks_just_the_constrained_rows(device, V, rng):
    """The sampler's path (on a GPU, the Triton kernel): the constrained rows masked exactly,
    every other row untouched, rows given out of order."""
    from ray_attn.runtime.sampling import SamplingTensors, apply_grammar

    B, rows = 6, np.array([4, 1, 5], np.int32)
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


def test_a_bitmask_of_the_wrong_shape_is_refused_by_name():
    from ray_attn.runtime.logits_processors import apply_token_bitmask_inplace

    logits = torch.zeros(4, 100)
    with pytest.raises(ValueError, match="grammar_bitmask"):
        apply_token_bitmask_inplace(logits, torch.tensor([0, 2]), torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="grammar_bitmask"):
        apply_token_bitmask_inplace(logits, torch.tensor([0, 2]), torch.zeros(1, 4, dtype=torch.int32))


def test_rank_grammars_refuse_a_matcher_out_of_step(tok):
    """Rank 0 raises, naming the request, rather than fill a mask from a matcher that is behind
    or ahead of the driver's, or from one it was never sent."""
    from ray_attn.runtime.grammars import RankGrammars
    from ray_attn.runtime.messages import SamplingInputs
    from ray_attn.structured_output import GrammarSync

    compiler = GrammarCompiler(tok, VOCAB, [EOS_ID])
    spec = SPECS[1]
    req = SimpleNamespace(request_id="r1", grammar=compiler.matcher(compiler.compile(spec), spec),
                          token_ids=[5, 6, 7], num_prompt_tokens=3, num_drafts=0, output_token_ids=[])
    plan = SimpleNamespace(attn=SimpleNamespace(query_start_loc=np.array([0, 3], np.int32)),
                           input_token_ids=np.array([5, 6, 7], np.int32))
    sync, rank = GrammarSync(), RankGrammars(VOCAB)

    def step(count=None):
        si = SamplingInputs()
        sync.fill(si, [0], [req])
        if count is not None:
            si.grammar_counts[:] = count
        return SimpleNamespace(plan=plan, sampling=si, prev_token_index=None, prev_token_rows=None, spec=None)

    first = rank.bitmask(step(), None)
    assert first.shape == (1, (VOCAB + 31) // 32) and (first != -1).any()  # a real mask
    with pytest.raises(RuntimeError, match="'r1'.* taken 0 tokens, the step expects 2"):
        rank.bitmask(step(count=2), None)
    sync.reset()  # the driver believes the rank is new; the rank is not told: a fresh rank is
    rank = RankGrammars(VOCAB)
    sync.matchers.add("r1")  # ... but here the driver wrongly thinks it sent the matcher
    with pytest.raises(RuntimeError, match="no grammar matcher for request 'r1'"):
        rank.bitmask(step(), None)


def byte_compiler(backend: str) -> GrammarCompiler:
    """A compiler over raw byte strings where id 0 is an ordinary token ("a"), id 4 the stop."""
    import xgrammar as xgr

    pieces = [b"a", b"b", b"c", b"-", b"\x00"] + [bytes([c]) for c in range(ord("d"), ord("z") + 1)]
    info = xgr.TokenizerInfo(pieces, xgr.VocabType.RAW, vocab_size=len(pieces), stop_token_ids=[4])
    return GrammarCompiler(None, len(pieces), tokenizer_info=info, backend=backend)


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_resent_history_keeps_token_0_and_drops_only_placeholders(backend):
    """A matcher sent to rank 0 (again, after a restart) comes with the request's output so far:
    every real id goes, 0 included, and only the -1 of the token still in flight is left out
    (rank 0 takes that one from the step before's output).  Rank 0's mask is then the driver's."""
    from ray_attn.runtime.grammars import RankGrammars
    from ray_attn.runtime.messages import SamplingInputs
    from ray_attn.structured_output import GrammarSync, fill_bitmask

    compiler = byte_compiler(backend)
    V = compiler.vocab_size
    spec = StructuredOutputsParams(regex="abc|bca|cab")  # after "a" only "b"; after "b" "c" or "ca"
    driver = compiler.matcher(compiler.compile(spec), spec)
    history = [0, 1, 2]  # "abc": the driver's matcher has taken all three
    assert all(driver.accept(t) for t in history)
    req = SimpleNamespace(request_id="r", grammar=driver, token_ids=[5, 6] + [0, 1, -1], num_prompt_tokens=2,
                          num_drafts=0, output_token_ids=[0, 1, -1])  # the 2 still on its way from the step before
    si = SamplingInputs()
    GrammarSync().fill(si, [0], [req])
    plan = SimpleNamespace(attn=SimpleNamespace(query_start_loc=np.array([0, 1], np.int32)),
                           input_token_ids=np.array([-1], np.int32))
    step = SimpleNamespace(plan=plan, sampling=si, prev_token_index=np.array([0]), prev_token_rows=np.array([0]),
                           spec=None)
    got = RankGrammars(V).bitmask(step, SimpleNamespace(token_ids=np.array([2])))
    np.testing.assert_array_equal(got, fill_bitmask([driver]))  # only the stop token now
    assert np.flatnonzero(np.unpackbits(got[0].view(np.uint8), bitorder="little")[:V]).tolist() == [4]


def test_a_grammar_rank_0_let_go_of_is_sent_again():
    """Rank 0 keeps the newest MAX_COMPILED grammars; GrammarSync keeps the same list, so a
    request with an older spec sends it again rather than find rank 0 without it."""
    from ray_attn.runtime.grammars import RankGrammars
    from ray_attn.runtime.messages import SamplingInputs
    from ray_attn.structured_output import MAX_COMPILED, GrammarSync, fill_bitmask

    compiler = byte_compiler("xgrammar")
    sync, rank = GrammarSync(), RankGrammars(compiler.vocab_size)
    plan = SimpleNamespace(attn=SimpleNamespace(query_start_loc=np.array([0, 1], np.int32)),
                           input_token_ids=np.array([6], np.int32))
    specs = [StructuredOutputsParams(regex=f"a{{{i}}}") for i in range(1, MAX_COMPILED + 3)] + \
        [StructuredOutputsParams(regex="a{1}")]
    for i, spec in enumerate(specs):
        g = compiler.matcher(compiler.compile(spec), spec)
        req = SimpleNamespace(request_id=f"r{i}", grammar=g, token_ids=[5, 6], num_prompt_tokens=2,
                              num_drafts=0, output_token_ids=[])
        si = SamplingInputs()
        sync.fill(si, [0], [req])
        got = rank.bitmask(SimpleNamespace(plan=plan, sampling=si, prev_token_index=None, spec=None), None)
        np.testing.assert_array_equal(got, fill_bitmask([g]))
        sync.drop(req.request_id)
    assert len(rank.compiled) == len(sync.specs) == MAX_COMPILED and list(rank.compiled) == list(sync.specs)


@pytest.mark.slow
def test_tp2_ray_ranks_give_the_single_process_outputs(tok, ray_local):
    """Two Ray ranks under async scheduling: rank 0 fills the masks and samples on its thread and
    broadcasts the tokens from there; the outputs are the in-process ones."""
    prompt = tok("hello world")["input_ids"]
    params = [SamplingParams(max_tokens=32, structured_outputs=sp, temperature=t, seed=i)
              for i, (sp, t) in enumerate((sp, t) for t in (0.0, 1.0) for sp in SPECS)]
    reference = engine(tok, False).generate([prompt] * len(params), params)
    cfg = config(tp=2, eos_token_ids=[EOS_ID]).model_copy(update={"async_scheduling": True})
    eng = LLMEngine(cfg)
    try:
        eng.grammar_compiler = GrammarCompiler(tok, VOCAB, [EOS_ID])
        outs = eng.generate([prompt] * len(params), params)
    finally:
        eng.shutdown()
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in reference]


@pytest.mark.parametrize("thread", [False, True])
def test_an_error_in_the_fill_is_raised_by_a_step(tok, monkeypatch, thread):
    """In line, by the step itself; on the rank's thread, by the next step."""
    from ray_attn.runtime.grammars import RankGrammars

    calls = []
    real = RankGrammars.bitmask

    def failing(self, step, previous, drafts=None):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fill failure")
        return real(self, step, previous, drafts)

    monkeypatch.setattr(RankGrammars, "bitmask", failing)
    eng = engine(tok, True, thread)
    eng.add_request(tok("hello world")["input_ids"], SamplingParams(max_tokens=20, structured_outputs=SPECS[1]))
    steps = 0
    with pytest.raises(RuntimeError, match="injected fill failure"):
        for _ in range(10):
            steps += 1
            eng.step()
    assert len(calls) == 3 and steps == 3 + thread
