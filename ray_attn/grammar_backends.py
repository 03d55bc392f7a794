"""The two grammar backends of structured outputs, vLLM's choice: ``xgrammar`` and ``guidance``
(llguidance).  Each one, on the driver, compiles a spec against the tokenizer's vocabulary and
makes the per-request matchers; and says what rank 0 rebuilds the same matchers from (the
vocabulary once, each compiled grammar once, as text), with the functions rank 0 rebuilds them
with (``runtime/grammars.py``).  Both fill int32 bitmask words of 32 ids, bit ``id % 32`` of word
``id // 32`` (xgrammar's ``allocate_token_bitmask`` and llguidance's ``numpy.allocate_token_bitmask``
are the same shape and layout), so one ``apply_token_bitmask_inplace`` serves both.

A matcher's ``accept(token) -> bool`` and ``terminated`` mean the same for both: the grammar is
complete once it has taken a stop token, and a refused token leaves the matcher ``terminated``
for masking (the driver ends that request; rank 0 stops filling its row).  Speculative decoding
adds ``accepts(tokens) -> int`` (how many drafts the grammar takes from here, the state left as it
is), ``try_accept(token) -> bool`` (take one draft, or refuse it and stay) and ``rollback(n)``
(forget the last n tokens taken: the rejected drafts).
"""

from __future__ import annotations

import json
from copy import copy

from ray_attn.json_schema_support import rfc8259_strings, strict_objects


def _choice_regex(choices) -> str:
    import re

    return "(" + "|".join(re.escape(c) for c in choices) + ")"


# ------------------------------------------------------------------------------------ xgrammar
class XgrammarMatcher:
    backend = "xgrammar"
    __slots__ = ("m",)

    def __init__(self, m):
        self.m = m

    def accept(self, token_id: int) -> bool:
        return self.m.accept_token(int(token_id))

    @property
    def terminated(self) -> bool:
        return self.m.is_terminated()

    def accepts(self, tokens) -> int:
        n = 0
        for t in tokens:  # xgrammar refuses a token without moving, and takes none once terminated
            if not self.m.accept_token(int(t)):
                break
            n += 1
        self.rollback(n)
        return n

    def try_accept(self, token_id: int) -> bool:
        return self.m.accept_token(int(token_id))

    def rollback(self, n: int) -> None:
        if n:
            self.m.rollback(n)

    _BATCH: list = []  # one xgrammar BatchGrammarMatcher (its thread pool), made on first use

    @classmethod
    def fill(cls, matchers: list, out, rows: list[int]) -> None:
        """Rows ``rows`` of ``out`` from ``matchers``, in one call on xgrammar's threads."""
        if not cls._BATCH:
            import xgrammar as xgr

            cls._BATCH.append(xgr.BatchGrammarMatcher(max_threads="auto"))
        cls._BATCH[0].batch_fill_next_token_bitmask([m.m for m in matchers], out, rows)


class XgrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids=None, tokenizer_info=None):
        import xgrammar as xgr

        self._xgr = xgr
        self.info = tokenizer_info or xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) if stop_token_ids else None)
        # xgrammar's own cache is off: the GrammarCompiler's (by spec, bounded) is the one cache
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=2, cache_enabled=False)
        self._payload = None

    def compile(self, spec):
        c, xgr = self._compiler, self._xgr
        if spec.json is not None or spec.json_object:
            text = spec.json if spec.json is not None else '{"type": "object"}'
            grammar = xgr.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=spec.json is not None)
            # the converted grammar with RFC 8259 strings (json_schema_support.rfc8259_strings)
            return c.compile_grammar(xgr.Grammar.from_ebnf(rfc8259_strings(str(grammar))))
        if spec.regex is not None:
            return c.compile_regex(spec.regex)
        if spec.choice is not None:
            return c.compile_regex(_choice_regex(spec.choice))
        return c.compile_grammar(spec.grammar)

    def matcher(self, compiled) -> XgrammarMatcher:
        return XgrammarMatcher(self._xgr.GrammarMatcher(compiled))

    @staticmethod
    def serialize(compiled) -> str:
        return compiled.serialize_json()

    def tokenizer_payload(self) -> str:
        """The vocabulary as xgrammar's JSON (~4 MB at 128k ids)."""
        if self._payload is None:
            self._payload = self.info.serialize_json()
        return self._payload

    # rank 0
    @staticmethod
    def rank_tokenizer(payload: str, vocab_size: int):
        import xgrammar as xgr

        return xgr.TokenizerInfo.deserialize_json(payload)

    @staticmethod
    def rank_compiled(tokenizer, text: str):
        import xgrammar as xgr

        return xgr.CompiledGrammar.deserialize_json(text, tokenizer)

    @staticmethod
    def rank_matcher(compiled) -> XgrammarMatcher:
        import xgrammar as xgr

        return XgrammarMatcher(xgr.GrammarMatcher(compiled))


# ------------------------------------------------------------------------------------ guidance
# JSON as xgrammar writes it with any_whitespace=False: ", " and ": ", no other whitespace.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GuidanceMatcher:
    backend = "guidance"
    __slots__ = ("m", "eos", "done", "pushed")

    def __init__(self, m, eos: frozenset):
        self.m, self.eos, self.done = m, eos, False
        # per token taken, whether llguidance counted it: an EOS taken once it has stopped (the
        # grammar could not go on) moves nothing, and its rollback must not count it
        self.pushed: list[bool] = []

    def accept(self, token_id: int) -> bool:
        counted = not self.m.is_stopped()
        ok = self.m.consume_token(int(token_id))
        # llguidance stops once the grammar cannot go on and allows only EOS then; like
        # xgrammar's, the grammar is complete when it has taken that EOS
        self.done = not ok or int(token_id) in self.eos
        if ok:
            self.pushed.append(counted)
            if len(self.pushed) > 512:  # a rollback reaches back a step's drafts, no further
                del self.pushed[:256]
        return ok

    @property
    def terminated(self) -> bool:
        return self.done or self.m.is_error()

    def accepts(self, tokens) -> int:
        if self.terminated:
            return 0
        return self.m.validate_tokens([int(t) for t in tokens])

    def try_accept(self, token_id: int) -> bool:
        return self.accepts([token_id]) == 1 and self.accept(token_id)

    def rollback(self, n: int) -> None:
        if not n:
            return
        if n > len(self.pushed) or self.m.is_error():
            raise RuntimeError(f"guidance matcher: cannot roll back {n} tokens")
        self.m.rollback(sum(self.pushed[-n:]))
        del self.pushed[-n:]
        self.done = False  # nothing is taken after a stop token, so the last n held it if any

    _EXECUTOR: list = []  # one llguidance LLExecutor (its thread pool), made on first use

    @classmethod
    def fill(cls, matchers: list, out, rows: list[int]) -> None:
        """Rows ``rows`` of ``out`` (C-contiguous int32) from ``matchers``, on llguidance's threads."""
        import llguidance
        import llguidance.numpy as lnp

        if not cls._EXECUTOR:
            cls._EXECUTOR.append(llguidance.LLExecutor())
        lnp.fill_next_token_bitmask_par(cls._EXECUTOR[0], [(m.m, r) for m, r in zip(matchers, rows)], out)


class _ByteVocab:
    """llguidance's view of a vocabulary of raw byte strings (xgrammar's ``TokenizerInfo`` of one,
    as benchmarks make over a checkpoint without a tokenizer): masks need only the bytes; the
    greedy longest-match encoder is what llguidance calls to tokenize text it forces."""

    def __init__(self, tokens: list[bytes], eos: list[int], special: list[int]):
        self.tokens, self.eos_token_id, self.bos_token_id = tokens, eos[0] if eos else None, None
        self.special_token_ids = special
        self._ids = {t: i for i, t in enumerate(tokens) if t and i not in set(special)}
        self._longest = max((len(t) for t in tokens), default=1)

    def __call__(self, data) -> list[int]:
        data = data.encode() if isinstance(data, str) else bytes(data)
        out, i = [], 0
        while i < len(data):
            for n in range(min(self._longest, len(data) - i), 0, -1):
                j = self._ids.get(data[i:i + n])
                if j is not None:
                    out.append(j)
                    i += n
                    break
            else:
                raise ValueError(f"byte {data[i]:#x} is no token of this vocabulary")
        return out


def _ll_tokenizer(payload: tuple, vocab_size: int):
    import llguidance

    kind, body, eos, special = payload
    if kind == "hf":  # a Hugging Face tokenizer's JSON, as llguidance.hf.from_tokenizer reads it
        return llguidance.LLTokenizer(body, n_vocab=vocab_size, eos_token=eos)
    wrapper = llguidance.TokenizerWrapper(_ByteVocab(body, eos, special))
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)


def _ll_matcher(tokenizer, grammar: str):
    """A matcher at the grammar's start, or a ValueError with llguidance's message."""
    import llguidance

    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
    if is_error:
        raise ValueError(messages[0] if messages else "llguidance refused the grammar")
    m = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if m.is_error():
        raise ValueError(m.get_error())
    return m


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids=None, tokenizer_info=None):
        self.vocab_size = vocab_size
        if tokenizer is not None:
            if not hasattr(tokenizer, "backend_tokenizer"):
                raise ValueError("the guidance backend needs a fast (Rust) Hugging Face tokenizer")
            backend = copy(tokenizer.backend_tokenizer)  # as llguidance.hf.from_tokenizer does
            backend.no_padding()
            backend.no_truncation()
            eos = list(stop_token_ids) if stop_token_ids else [tokenizer.eos_token_id]
            self.payload = ("hf", backend.to_str(), eos, [])
        elif tokenizer_info is not None:
            self.payload = ("bytes", list(tokenizer_info.decoded_vocab), list(tokenizer_info.stop_token_ids),
                            list(tokenizer_info.special_token_ids))
        else:
            raise ValueError("the guidance backend needs a tokenizer")
        self.tokenizer = _ll_tokenizer(self.payload, vocab_size)
        self.eos = frozenset(self.tokenizer.eos_tokens)

    def grammar_text(self, spec) -> str:
        """The spec as llguidance's grammar (JSON text): what the driver and rank 0 both build from."""
        import llguidance

        if spec.json is not None or spec.json_object:
            schema = json.loads(spec.json) if spec.json is not None else {"type": "object"}
            if isinstance(schema, dict) and spec.json is not None:
                schema = strict_objects(schema)
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        if spec.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(list(spec.choice)))
        return llguidance.grammar_from("grammar", spec.grammar)  # GBNF (converted) or Lark

    def compile(self, spec):
        """A matcher at the grammar's start; each request's is a copy of it (no second build)."""
        text = self.grammar_text(spec)
        return _GuidanceCompiled(text, _ll_matcher(self.tokenizer, text))

    def matcher(self, compiled) -> GuidanceMatcher:
        return GuidanceMatcher(compiled.start.deep_copy(), self.eos)

    @staticmethod
    def serialize(compiled) -> str:
        return compiled.text

    def tokenizer_payload(self) -> tuple:
        """("hf", the tokenizer's JSON, eos ids, []) or ("bytes", the tokens' bytes, eos ids,
        special ids): what ``_ll_tokenizer`` rebuilds the same LLTokenizer from."""
        return self.payload

    # rank 0
    @staticmethod
    def rank_tokenizer(payload: tuple, vocab_size: int):
        return _ll_tokenizer(payload, vocab_size)

    @staticmethod
    def rank_compiled(tokenizer, text: str):
        try:
            return _GuidanceCompiled(text, _ll_matcher(tokenizer, text), frozenset(tokenizer.eos_tokens))
        except ValueError as e:
            raise RuntimeError(f"rank 0: llguidance refused a grammar the driver compiled ({e})") from None

    @staticmethod
    def rank_matcher(compiled) -> GuidanceMatcher:
        return GuidanceMatcher(compiled.start.deep_copy(), compiled.eos)


class _GuidanceCompiled:
    __slots__ = ("text", "start", "eos")

    def __init__(self, text: str, start, eos: frozenset = frozenset()):
        self.text, self.start, self.eos = text, start, eos


BACKENDS = {"xgrammar": XgrammarBackend, "guidance": GuidanceBackend}
MATCHERS = {"xgrammar": XgrammarMatcher, "guidance": GuidanceMatcher}
