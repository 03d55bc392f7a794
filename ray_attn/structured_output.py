"""Structured outputs: the tokens a request may draw next, from a grammar (vLLM's
``StructuredOutputsParams``: a JSON schema, any JSON object, a regex, a choice of strings, or an
EBNF grammar), through xgrammar -- what vLLM, SGLang and TensorRT-LLM use.

The pieces sit where the rest of the engine puts them:

- **Compiling** a grammar against the tokenizer's vocabulary is the slow part (milliseconds to
  seconds for a large schema), so a server does it on a thread of its own before the request
  reaches the engine (``GrammarCompiler.compile`` caches by spec), and a spec it cannot compile is
  a ``ValueError`` naming it.
- **The driver** keeps one ``GrammarMatcher`` per constrained request, advanced by each token the
  request gets back: it checks each token and ends the request when its grammar is complete.
- **Rank 0** keeps a matcher of its own per constrained request (``runtime/grammars.py``) and
  fills the step's bitmask rows from them (``fill_bitmask``: one bit per vocabulary id, int32
  words, only for the rows that have a grammar), then sets the disallowed logits to -inf before
  the penalties and the draw (``runtime/logits_processors.apply_token_bitmask_inplace``).
  ``GrammarSync`` is the driver's record of what rank 0 holds: the tokenizer, the compiled
  grammars and the matchers, each sent once (and again after the ranks are restarted).

Why the mask is filled on rank 0: under async scheduling step N+1 is planned and sent before
step N's tokens are back on the driver, so the driver cannot know a constrained row's mask for
N+1.  Rank 0 can: it queues N+1's forward on the GPU, then reads N's tokens (their copy to the
host was queued before that forward), advances its matchers and fills the mask while the forward
runs, and only then queues N+1's sampling.  So a constrained row runs every step, the mask for
N+1 waits for N's token and nothing else does, and the fill's cost hides behind the forward
whenever the forward takes longer (``scripts/bench_structured.py`` measures both).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Optional

import numpy as np

BITS = 32  # vocabulary ids per bitmask word (xgrammar's int32 layout)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match (vLLM's names); exactly one field is set."""

    json: Optional[str] = None  # a JSON schema, as text
    json_object: bool = False  # any JSON object
    regex: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None
    grammar: Optional[str] = None  # EBNF (GBNF), xgrammar's dialect

    def __post_init__(self):
        set_ = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        set_ += ["json_object"] if self.json_object else []
        if len(set_) != 1:
            raise ValueError(f"structured_outputs: exactly one of json, json_object, regex, choice, grammar "
                             f"must be given, got {set_ or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice: a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None) \
            if not self.json_object else "json_object"


def _choice_regex(choices: tuple[str, ...]) -> str:
    import re

    return "(" + "|".join(re.escape(c) for c in choices) + ")"


class GrammarCompiler:
    """Compiled grammars for one tokenizer, cached by spec (thread-safe: servers compile on a
    worker thread while the engine thread builds matchers)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids=None, cache_size: int = 256,
                 tokenizer_info=None):
        """``tokenizer`` an HF tokenizer, or None with ``tokenizer_info`` (an xgrammar
        ``TokenizerInfo``, e.g. over a vocabulary of raw byte strings)."""
        import xgrammar as xgr

        self._xgr = xgr
        info = tokenizer_info or xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) if stop_token_ids else None)
        # xgrammar's own cache is off: ``_cache`` (by spec, bounded) is the one cache
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.vocab_size = vocab_size
        self._info, self._info_json = info, None
        self._cache: dict[StructuredOutputsParams, object] = {}
        self._serialized: dict[StructuredOutputsParams, str] = {}
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams, field: str = "structured_outputs"):
        """The spec's compiled grammar; a ``ValueError`` starting with ``field`` when it cannot be."""
        with self._lock:
            hit = self._cache.get(spec)
        if hit is not None:
            return hit
        c = self._compiler
        try:
            if spec.json is not None:
                schema = json.loads(spec.json)
                if not isinstance(schema, (dict, bool)):
                    raise ValueError("a JSON schema is an object")
                compiled = c.compile_json_schema(spec.json, any_whitespace=False, strict_mode=True)
            elif spec.json_object:
                compiled = c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            elif spec.regex is not None:
                compiled = c.compile_regex(spec.regex)
            elif spec.choice is not None:
                compiled = c.compile_regex(_choice_regex(spec.choice))
            else:
                compiled = c.compile_grammar(spec.grammar)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError/its own
            raise ValueError(f"{field}: cannot compile the {spec.kind} ({str(e).splitlines()[0][:300]})") from None
        with self._lock:
            if len(self._cache) >= self._cache_size:
                self._cache.pop(next(iter(self._cache)))
            self._cache[spec] = compiled
        return compiled

    def matcher(self, compiled, spec: StructuredOutputsParams | None = None) -> "GrammarState":
        return GrammarState(self._xgr.GrammarMatcher(compiled), self.vocab_size, spec, self)

    def serialized(self, spec: StructuredOutputsParams) -> str:
        """The spec's compiled grammar as xgrammar's JSON (what rank 0 builds its matcher from)."""
        with self._lock:
            hit = self._serialized.get(spec)
        if hit is None:
            hit = self.compile(spec).serialize_json()
            with self._lock:
                if len(self._serialized) >= self._cache_size:
                    self._serialized.pop(next(iter(self._serialized)))
                self._serialized[spec] = hit
        return hit

    def tokenizer_info_json(self) -> str:
        """The tokenizer's vocabulary as xgrammar's JSON: sent to rank 0 once (~4 MB at 128k ids)."""
        if self._info_json is None:
            self._info_json = self._info.serialize_json()
        return self._info_json


class GrammarState:
    """One request's place in its grammar, on the driver; ``spec`` and ``compiler`` say what
    rank 0 rebuilds it from."""

    def __init__(self, matcher, vocab_size: int, spec: StructuredOutputsParams | None = None,
                 compiler: GrammarCompiler | None = None):
        self.matcher = matcher
        self.words = (vocab_size + BITS - 1) // BITS
        self.spec, self.compiler = spec, compiler

    def accept(self, token_id: int) -> bool:
        return self.matcher.accept_token(int(token_id))

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


_BATCH: list = []  # one xgrammar BatchGrammarMatcher (its thread pool), made on first use


def fill_bitmask(states: list[GrammarState]) -> np.ndarray:
    """int32 [len(states), words]: the rows' allowed next tokens, bit ``id % 32`` of word ``id // 32``.
    One call into xgrammar fills every row, on its own threads: a 128k vocabulary costs tens of
    microseconds a row, which a Python loop would pay one row after another on the driver."""
    out = np.empty((len(states), states[0].words), np.int32)
    if not _BATCH:
        import xgrammar as xgr

        _BATCH.append(xgr.BatchGrammarMatcher(max_threads="auto"))
    _BATCH[0].batch_fill_next_token_bitmask([s.matcher for s in states], out)
    return out


class GrammarSync:
    """What rank 0 holds of the driver's grammars, so that each thing travels once: the
    tokenizer's vocabulary, each compiled grammar, each request's matcher (its output tokens so
    far, once), and the matchers to drop.  ``reset`` when the ranks are restarted."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.tokenizer_sent = False
        self.specs: set[StructuredOutputsParams] = set()
        self.matchers: set[str] = set()
        self.drops: list[str] = []

    def drop(self, request_id: str) -> None:
        if request_id in self.matchers:
            self.matchers.discard(request_id)
            self.drops.append(request_id)

    def fill(self, si, rows: list[int], reqs: list) -> None:
        """Set ``si``'s grammar fields for the constrained sampling ``rows`` (``reqs`` theirs),
        before this step's placeholders are appended: ``grammar_counts`` are the output tokens
        each row's matcher must have taken before its mask (the newest of them is the row's last
        input token, which rank 0 takes itself when its matcher is one behind)."""
        new, specs = {}, {}
        for r in reqs:
            g = r.grammar
            if r.request_id in self.matchers:
                continue
            if g.spec is None or g.compiler is None:
                raise ValueError(f"request {r.request_id!r}: its GrammarState has no spec to rebuild on rank 0")
            if not self.tokenizer_sent:
                si.grammar_tokenizer = g.compiler.tokenizer_info_json()
                self.tokenizer_sent = True
            if g.spec not in self.specs:
                specs[g.spec] = g.compiler.serialized(g.spec)
                self.specs.add(g.spec)
            new[r.request_id] = (g.spec, [t for t in r.output_token_ids if t >= 0])
            self.matchers.add(r.request_id)
        si.grammar_rows = np.array(rows, np.int32)
        si.grammar_keys = [r.request_id for r in reqs]
        si.grammar_counts = np.array([len(r.token_ids) - r.num_prompt_tokens for r in reqs], np.int32)
        si.grammar_new, si.grammar_specs = new or None, specs or None
        self.take_drops(si)

    def take_drops(self, si) -> None:
        if self.drops:
            si.grammar_drop, self.drops = self.drops, []
