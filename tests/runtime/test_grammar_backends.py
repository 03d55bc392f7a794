"""Structured outputs that always parse, at the grammar layer (no model, no Ray): a driver matcher
of each backend walks its grammar drawing uniformly among the allowed tokens of a byte-level BPE
vocabulary -- what a random model at temperature 1 does, and what finds any byte a grammar lets
through -- for many seeds, and every output must pass strict ``json.loads`` and
``jsonschema.validate``.  At every step rank 0's matcher, rebuilt from what ``GrammarSync`` ships
(the backend's vocabulary payload, the grammar as text), must give the same mask.  Then the
``auto`` rule: each schema keyword xgrammar would not honour goes to guidance, which honours it
(the outputs validate) or refuses it by name."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest

from ray_attn.grammar_backends import BACKENDS
from ray_attn.json_schema_support import rfc8259_strings, xgrammar_misses
from ray_attn.serve.openai.tools import forced_calls, forced_spec
from ray_attn.structured_output import GrammarCompiler, StructuredOutputsParams, fill_bitmask
from tests.tokenizer_fixture import EOS_ID, build_tokenizer

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

VOCAB = 384
SEEDS = 30
BACKEND_NAMES = ["xgrammar", "guidance"]

S = lambda **k: dict(type="string", **k)  # noqa: E731
OBJ = lambda required=True, **props: {"type": "object", "properties": props,  # noqa: E731
                                      "required": list(props) if required else [], "additionalProperties": False}
# Bounded everywhere, so that a uniform walk ends well within MAX_STEPS.
SCHEMAS = {
    "lengths": OBJ(name=S(maxLength=12), nick=S(minLength=2, maxLength=5), code=S(minLength=3, maxLength=3)),
    "pattern": OBJ(code=S(pattern=r"^[A-Z]{2}-\d{3}$"), any=S(pattern=r"^.{1,6}$"), word=S(pattern=r"^\w{1,4}$")),
    "enums": OBJ(color={"enum": ["red", "tab\there", 'quo"te', "[^a]", "new\nline"]},
                 n={"enum": [1, 2.5, None, True]}, c={"const": "x\u0001y"}),
    "nested_arrays": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "array", "minItems": 1, "maxItems": 3, "items": S(maxLength=4)}},
    "formats": OBJ(d=S(format="date"), t=S(format="time"), u=S(format="uuid"), ip=S(format="ipv4")),
    "optional_and_numbers": OBJ(required=False, a=S(maxLength=3), n={"type": "integer", "minimum": -5, "maximum": 20},
                                x={"type": "number", "minimum": 0, "maximum": 2}, b={"type": "boolean"}),
}
WEATHER = OBJ(city=S(maxLength=10), days={"type": "integer", "minimum": 1, "maximum": 7})
TIME = OBJ(tz=S(minLength=1, maxLength=4))
TOOLS = [SimpleNamespace(function=SimpleNamespace(name="get_weather", parameters=WEATHER)),
         SimpleNamespace(function=SimpleNamespace(name="get_time", parameters=TIME))]
MAX_STEPS = 400


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    d = tmp_path_factory.mktemp("tok")
    build_tokenizer(d, VOCAB)
    return AutoTokenizer.from_pretrained(str(d), local_files_only=True)


@pytest.fixture(scope="module")
def vocab_bytes(tok) -> list[bytes]:
    """Each id's bytes (xgrammar reads them out of the byte-level tokenizer)."""
    import xgrammar as xgr

    return xgr.TokenizerInfo.from_huggingface(tok, vocab_size=VOCAB).decoded_vocab


@pytest.fixture(scope="module")
def compilers(tok):
    return {b: GrammarCompiler(tok, VOCAB, [EOS_ID], backend=b) for b in BACKEND_NAMES + ["auto"]}


def rank_matcher(compiler, spec):
    """Rank 0's matcher for ``spec``, from what GrammarSync ships: the payloads, as text."""
    name, text = compiler.serialized(spec)
    b = BACKENDS[name]
    return b.rank_matcher(b.rank_compiled(b.rank_tokenizer(compiler.tokenizer_payload(name), VOCAB), text))


def allowed(state) -> np.ndarray:
    words = fill_bitmask([state])[0]
    return np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:VOCAB])


def walk(compiler, spec, seed, check_rank=True) -> list[int]:
    """The token ids of one uniform walk to the grammar's end (EOS included)."""
    rng = np.random.default_rng(seed)
    state = compiler.matcher(compiler.compile(spec), spec)
    rank = type(state)(rank_matcher(compiler, spec), VOCAB) if check_rank else None
    ids = []
    for _ in range(MAX_STEPS):
        ok = allowed(state)
        if rank is not None:
            np.testing.assert_array_equal(allowed(rank), ok, err_msg="rank 0's mask is not the driver's")
        t = int(rng.choice(ok))
        assert state.accept(t), f"the matcher refused token {t}, which its own mask allowed"
        if rank is not None:
            assert rank.accept(t)
        ids.append(t)
        if state.terminated:
            assert ids[-1] == EOS_ID
            return ids
    raise AssertionError(f"no end within {MAX_STEPS} tokens: {ids}")


def strict_json(tok, ids):
    """The text and its JSON: UTF-8 (the tokenizer decodes bytes that are not as U+FFFD) and
    strict (a raw control character in a string is an error)."""
    text = tok.decode(ids, skip_special_tokens=True)
    assert "\ufffd" not in text, f"not UTF-8: {text!r}"
    return text, json.loads(text)


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_output_parses_and_validates(tok, compilers, backend, name):
    """The defect: xgrammar 0.2.9's length-bounded strings let U+0000-U+001F through, and 4 of 6
    seeds at temperature 1 came back unparsable ("Invalid control character")."""
    spec = StructuredOutputsParams(json=json.dumps(SCHEMAS[name]))
    for seed in range(SEEDS):
        text, obj = strict_json(tok, walk(compilers[backend], spec, seed, check_rank=seed < 5))
        jsonschema.validate(obj, SCHEMAS[name])


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("mode", ["required", "named"])
def test_forced_tool_calls_always_parse(tok, compilers, backend, mode):
    choice = "required" if mode == "required" else SimpleNamespace(function=SimpleNamespace(name="get_time"))
    spec = forced_spec(TOOLS, choice, parallel_tool_calls=False if mode == "required" else None)
    schemas = {t.function.name: t.function.parameters for t in TOOLS}
    for seed in range(SEEDS):
        text, _ = strict_json(tok, walk(compilers[backend], spec, seed, check_rank=seed < 3))
        calls = forced_calls(text, choice, "stop")
        assert len(calls) == 1
        jsonschema.validate(json.loads(calls[0].arguments), schemas[calls[0].name])


@pytest.mark.parametrize("backend", BACKEND_NAMES)
@pytest.mark.parametrize("fmt", ["email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname",
                                 "uuid", "uri", "uri-reference", "uri-template", "json-pointer",
                                 "relative-json-pointer"])
def test_no_string_rule_lets_a_control_character_or_a_surrogate_through(tok, vocab_bytes, compilers, backend, fmt):
    """Every format's string, bounded or not: every prefix a walk reaches is UTF-8 (what may be
    cut is the last character) without U+0000-U+001F.  A format llguidance does not know it
    refuses by name (auto then compiles it on xgrammar)."""
    import codecs

    spec = StructuredOutputsParams(json=json.dumps(S(format=fmt)))
    c = compilers[backend]
    try:
        compiled = c.compile(spec)
    except ValueError as e:
        assert backend == "guidance" and f"Unknown format: {fmt}" in str(e)
        assert compilers["auto"].compile(spec).backend == "xgrammar"
        return
    for seed in range(8):
        rng, state, raw = np.random.default_rng(seed), c.matcher(compiled, spec), b""
        for _ in range(40):
            t = int(rng.choice(allowed(state)))
            assert state.accept(t)
            if state.terminated:
                break
            raw += vocab_bytes[t]
        text = codecs.getincrementaldecoder("utf-8")("strict").decode(raw, final=False)  # raises if not UTF-8
        assert not re.search("[\x00-\x1f]", text), repr(text)


def test_rfc8259_strings_rewrites_classes_and_leaves_literals():
    ebnf = 'a ::= "[^x]" [^\\"\\\\] ("\\"" [^\\0-\\x1f\\"] Regex("[^y]") [a\\]^]) [\\^] [\\x7f-\\U0010ffff]'
    x = "[^\\0-\\x1f\\ud800-\\udfff"
    assert rfc8259_strings(ebnf) == (f'a ::= "[^x]" {x}\\"\\\\] ("\\"" {x}\\0-\\x1f\\"] Regex("[^y]") '
                                     '[a\\]^]) [\\^] [\\U0000007f-\\U0000d7ff\\U0000e000-\\U0010ffff]')
    assert rfc8259_strings(rfc8259_strings(ebnf)) == rfc8259_strings(ebnf)


# ------------------------------------------------------------------------------ the auto rule
# (schema, what xgrammar_misses names): each measured giving outputs the schema rejects on xgrammar
MISSED = [
    (S(pattern="^[a-z]+$", maxLength=4), "minLength/maxLength with pattern or format"),
    (S(format="date", minLength=1, maxLength=10), "minLength/maxLength with pattern or format"),
    ({"enum": ["aaaa", "b"], "maxLength": 2}, "enum/const with maxLength"),
    ({"allOf": [{"type": "integer", "minimum": 0}, {"maximum": 5}]}, "allOf"),
    ({"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "number", "minimum": 0, "maximum": 9}]},
     "oneOf"),
    ({"type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": 3}, "multipleOf"),
    ({"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True, "maxItems": 3}, "uniqueItems"),
    ({"type": "array", "items": {"enum": [1, 2, 3]}, "contains": {"const": 3}, "maxItems": 3}, "contains"),
    ({"type": "integer", "minimum": 0, "maximum": 5, "not": {"const": 3}}, "not"),
    (OBJ(required=False, a={"type": "boolean"}, b={"type": "boolean"}) | {"dependentRequired": {"a": ["b"]}},
     "dependentRequired"),
]


@pytest.mark.parametrize("schema,keyword", MISSED)
def test_auto_sends_what_xgrammar_misses_to_guidance(tok, compilers, schema, keyword):
    """auto gives guidance the schema: every output validates, or guidance refuses it naming the
    keyword (a 400 upstream), never an output the schema rejects.  An explicit xgrammar refuses."""
    spec = StructuredOutputsParams(json=json.dumps({"type": "object", "properties": {"v": schema},
                                                    "required": ["v"], "additionalProperties": False}))
    assert any(m.endswith(keyword) and m.startswith("/properties/v") for m in xgrammar_misses(json.loads(spec.json)))
    with pytest.raises(ValueError, match=f"structured_outputs: the xgrammar backend would not honour.*{keyword}"):
        compilers["xgrammar"].compile(spec)
    auto = compilers["auto"]
    assert auto.backends_for(spec) == ["guidance"]
    try:
        compiled = auto.compile(spec)
    except ValueError as e:
        assert "guidance:" in str(e)  # refused by the one backend that would have honoured it
        return
    assert compiled.backend == "guidance"
    for seed in range(20):
        jsonschema.validate(strict_json(tok, walk(auto, spec, seed, check_rank=False))[1]["v"], schema)


@pytest.mark.parametrize("schema", [
    OBJ(required=False, a={"type": "boolean"}, b={"type": "boolean"}, c={"type": "boolean"}) | {"minProperties": 2},
    {"type": "object", "propertyNames": {"maxLength": 3}, "additionalProperties": {"type": "boolean"},
     "maxProperties": 2},
])
def test_auto_keeps_on_xgrammar_what_only_it_reads(tok, compilers, schema):
    """Keywords llguidance refuses and xgrammar honours stay on xgrammar (propertyNames' lengths
    are the strings the control-character repair covers for keys)."""
    spec = StructuredOutputsParams(json=json.dumps(schema))
    assert xgrammar_misses(schema) == []
    with pytest.raises(ValueError, match="guidance"):
        compilers["guidance"].compile(spec)
    compiled = compilers["auto"].compile(spec)
    assert compiled.backend == "xgrammar"
    for seed in range(SEEDS):
        jsonschema.validate(strict_json(tok, walk(compilers["auto"], spec, seed, check_rank=seed < 3))[1], schema)


def test_auto_falls_back_to_guidance_when_xgrammar_cannot_compile(tok, compilers):
    lark = 'start: "ab" x\nx: /[0-9]{2}/'  # Lark: guidance reads it, xgrammar's EBNF parser does not
    spec = StructuredOutputsParams(grammar=lark)
    with pytest.raises(ValueError, match="structured_outputs: cannot compile the grammar"):
        compilers["xgrammar"].compile(spec)
    assert compilers["auto"].compile(spec).backend == "guidance"
    for seed in range(5):
        assert re.fullmatch("ab[0-9]{2}", tok.decode(walk(compilers["auto"], spec, seed), skip_special_tokens=True))
    bad = StructuredOutputsParams(regex="(unclosed")
    with pytest.raises(ValueError, match=r"cannot compile the regex \(xgrammar: .*; guidance: .*\)"):
        compilers["auto"].compile(bad)


def test_an_unknown_backend_is_refused_by_name(tok):
    with pytest.raises(ValueError, match="structured_outputs.backend: one of auto, xgrammar, guidance"):
        GrammarCompiler(tok, VOCAB, [EOS_ID], backend="outlines")


@pytest.mark.parametrize("backend", BACKEND_NAMES)
def test_our_mask_reads_each_backends_bitmask_as_the_backend_does(tok, compilers, backend):
    """The layout: ``apply_token_bitmask`` keeps exactly the ids each library says are allowed
    by its own other reading -- llguidance's one-byte-per-id logit bias, xgrammar's own
    ``apply_token_bitmask_inplace`` -- at every state of a few walks."""
    import torch
    import xgrammar as xgr

    from ray_attn.runtime.logits_processors import apply_token_bitmask

    spec = StructuredOutputsParams(json=json.dumps(SCHEMAS["lengths"]))
    c = compilers[backend]
    for seed in range(3):
        rng, state = np.random.default_rng(seed), c.matcher(c.compile(spec), spec)
        while not state.terminated:
            words = fill_bitmask([state])
            ours = torch.isfinite(apply_token_bitmask(torch.zeros(1, VOCAB), torch.from_numpy(words)))[0]
            if backend == "guidance":
                theirs = torch.from_numpy(np.frombuffer(state.matcher.m.compute_logit_bias(), np.uint8)[:VOCAB] > 0)
            else:
                logits = torch.zeros(1, VOCAB)
                xgr.apply_token_bitmask_inplace(logits, torch.from_numpy(words))
                theirs = torch.isfinite(logits)[0]
            assert torch.equal(ours, theirs)
            assert state.accept(int(rng.choice(np.flatnonzero(ours.numpy()))))
