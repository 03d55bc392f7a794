"""Structured outputs: the tokens a request may draw next, from a grammar (vLLM's
``StructuredOutputsParams``: a JSON schema, any JSON object, a regex, a choice of strings, or an
EBNF grammar), through vLLM's choice of backends (``StructuredOutputsConfig.backend``):
xgrammar -- what vLLM, SGLang and TensorRT-LLM use -- or guidance (llguidance), or ``auto``,
which sends each spec to the one that gets it right (``GrammarCompiler.backends_for``).  The
backends live in ``grammar_backends.py``; what each gets right of a JSON schema, and the repair
of xgrammar's strings (RFC 8259: no raw control characters), in ``json_schema_support.py``.

The pieces sit where the rest of the engine puts them:

- **Compiling** a grammar against the tokenizer's vocabulary is the slow part (milliseconds to
  seconds for a large schema), so a server does it on a thread of its own before the request
  reaches the engine (``GrammarCompiler.compile`` caches by spec), and a spec it cannot compile is
  a ``ValueError`` naming it.
- **The driver** keeps one matcher per constrained request, advanced by each token the
  request gets back: it checks each token and ends the request when its grammar is complete.
- **Rank 0** keeps a matcher of its own per constrained request (``runtime/grammars.py``) and
  fills the step's bitmask rows from them (``fill_bitmask``: one bit per vocabulary id, int32
  words, only for the rows that have a grammar, one batch call per backend), then sets the
  disallowed logits to -inf before the penalties and the draw
  (``runtime/logits_processors.apply_token_bitmask_inplace``).  ``GrammarSync`` is the driver's
  record of what rank 0 holds: each backend's vocabulary, the compiled grammars (as text) and
  the matchers, each sent once (and again after the ranks are restarted).

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
from typing import Literal, Optional

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

BITS = 32  # vocabulary ids per bitmask word (both backends' int32 layout)
MAX_COMPILED = 256  # compiled grammars rank 0 keeps (by spec, oldest out first); GrammarSync mirrors it
BACKEND_NAMES = ("auto", "xgrammar", "guidance")


class StructuredOutputsConfig(BaseModel):
    """vLLM's ``structured_outputs_config``: which grammar backend compiles the specs."""

    model_config = ConfigDict(extra="forbid")

    backend: Literal["auto", "xgrammar", "guidance"] = Field(
        "auto", description="'xgrammar', 'guidance' (llguidance), or 'auto': xgrammar, except a JSON "
                            "schema with a keyword xgrammar would not honour (allOf, oneOf, not, "
                            "if/then/else, uniqueItems, contains, dependentRequired, multipleOf on "
                            "numbers, a length with a pattern or format, an enum with more checks) "
                            "and a spec xgrammar cannot compile go to guidance. An explicit "
                            "xgrammar refuses such a schema with a 400 naming the keyword.")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What a request's output must match (vLLM's names); exactly one field is set."""

    json: Optional[str] = None  # a JSON schema, as text
    json_object: bool = False  # any JSON object
    regex: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None
    grammar: Optional[str] = None  # EBNF (GBNF), xgrammar's dialect; guidance also reads Lark

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


@dataclass(frozen=True)
class CompiledGrammar:
    backend: str  # "xgrammar" or "guidance"
    grammar: object  # the backend's compiled grammar


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


class GrammarCompiler:
    """Compiled grammars for one tokenizer, cached by spec (thread-safe: servers compile on a
    worker thread while the engine thread builds matchers), through the ``backend`` of
    ``StructuredOutputsConfig`` (``grammar_backends.py`` holds the two)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids=None, cache_size: int = 256,
                 tokenizer_info=None, backend: str = "auto"):
        """``tokenizer`` an HF tokenizer, or None with ``tokenizer_info`` (an xgrammar
        ``TokenizerInfo``, e.g. over a vocabulary of raw byte strings)."""
        if backend not in BACKEND_NAMES:
            raise ValueError(f"structured_outputs.backend: one of {', '.join(BACKEND_NAMES)}, got {backend!r}")
        if tokenizer is None and tokenizer_info is None:
            raise ValueError("GrammarCompiler: a tokenizer or a tokenizer_info")
        self.backend, self.vocab_size = backend, vocab_size
        self._args = (tokenizer, vocab_size, stop_token_ids, tokenizer_info)
        self._backends: dict[str, object] = {}  # made on first use: each reads the whole vocabulary
        self._cache: dict[StructuredOutputsParams, CompiledGrammar] = {}
        self._serialized: dict[StructuredOutputsParams, tuple[str, str]] = {}
        self._cache_size = cache_size
        self._lock = threading.Lock()
        if backend != "guidance":  # the default one's tables now, not under the first request
            self._backend("xgrammar")

    def _backend(self, name: str):
        with self._lock:
            b = self._backends.get(name)
            if b is None:
                from ray_attn.grammar_backends import BACKENDS

                b = self._backends[name] = BACKENDS[name](*self._args[:3], tokenizer_info=self._args[3])
            return b

    def backends_for(self, spec: StructuredOutputsParams) -> list[str]:
        """The backends to try, in order.  ``auto`` (the rule, measured on xgrammar 0.2.9 and
        llguidance 1.9: ``json_schema_support.xgrammar_misses``): a JSON schema with a keyword
        xgrammar would not honour goes to guidance alone -- it honours the keyword or refuses the
        schema naming it, never answers with JSON the schema rejects; anything else goes to
        xgrammar, and to guidance when xgrammar cannot compile it (a Lark grammar, a regex or
        schema form only llguidance reads)."""
        if self.backend != "auto":
            return [self.backend]
        if spec.json is not None and self._misses(spec):
            return ["guidance"]
        return ["xgrammar", "guidance"]

    @staticmethod
    def _misses(spec: StructuredOutputsParams) -> list[str]:
        from ray_attn.json_schema_support import xgrammar_misses

        return xgrammar_misses(json.loads(spec.json))

    def compile(self, spec: StructuredOutputsParams, field: str = "structured_outputs") -> CompiledGrammar:
        """The spec's compiled grammar; a ``ValueError`` starting with ``field`` when it cannot be."""
        with self._lock:
            hit = self._cache.get(spec)
        if hit is not None:
            return hit
        if spec.json is not None:
            try:
                schema = json.loads(spec.json)
            except ValueError as e:
                raise ValueError(f"{field}: cannot compile the json (not JSON: {e})") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"{field}: cannot compile the json (a JSON schema is an object)")
        if self.backend == "xgrammar" and spec.json is not None:
            misses = self._misses(spec)
            if misses:
                raise ValueError(f"{field}: the xgrammar backend would not honour {'; '.join(misses[:4])} "
                                 f"(its output could fail the schema); use structured_outputs.backend "
                                 f"guidance or auto")
        errors = []
        for name in self.backends_for(spec):
            try:
                compiled = CompiledGrammar(name, self._backend(name).compile(spec))
                break
            except Exception as e:  # noqa: BLE001 - each backend raises RuntimeError/ValueError/its own
                errors.append(f"{name}: {_first_line(e)}")
        else:
            raise ValueError(f"{field}: cannot compile the {spec.kind} ({'; '.join(errors)})")
        with self._lock:
            if len(self._cache) >= self._cache_size:
                self._cache.pop(next(iter(self._cache)))
            self._cache[spec] = compiled
        return compiled

    def matcher(self, compiled: CompiledGrammar, spec: StructuredOutputsParams | None = None) -> "GrammarState":
        return GrammarState(self._backend(compiled.backend).matcher(compiled.grammar), self.vocab_size, spec, self)

    def serialized(self, spec: StructuredOutputsParams) -> tuple[str, str]:
        """(backend, the spec's compiled grammar as text): what rank 0 builds its matcher from."""
        with self._lock:
            hit = self._serialized.get(spec)
        if hit is None:
            c = self.compile(spec)
            hit = (c.backend, self._backend(c.backend).serialize(c.grammar))
            with self._lock:
                if len(self._serialized) >= self._cache_size:
                    self._serialized.pop(next(iter(self._serialized)))
                self._serialized[spec] = hit
        return hit

    def tokenizer_payload(self, backend: str):
        """The vocabulary as ``backend`` rebuilds it on rank 0: sent once (~4 MB at 128k ids)."""
        return self._backend(backend).tokenizer_payload()


class GrammarState:
    """One request's place in its grammar (``matcher``: a ``grammar_backends`` matcher), on the
    driver; ``spec`` and ``compiler`` say what rank 0 rebuilds it from."""

    def __init__(self, matcher, vocab_size: int, spec: StructuredOutputsParams | None = None,
                 compiler: GrammarCompiler | None = None):
        self.matcher = matcher
        self.words = (vocab_size + BITS - 1) // BITS
        self.spec, self.compiler = spec, compiler

    @property
    def backend(self) -> str:
        return self.matcher.backend

    def accept(self, token_id: int) -> bool:
        return self.matcher.accept(token_id)

    @property
    def terminated(self) -> bool:
        return self.matcher.terminated

    def accepts(self, tokens) -> int:
        """How many of ``tokens`` the grammar takes in order from here; the state stays (drafts)."""
        return self.matcher.accepts(tokens)

    def try_accept(self, token_id: int) -> bool:
        return self.matcher.try_accept(token_id)

    def rollback(self, n: int) -> None:
        self.matcher.rollback(n)


def fill_bitmask(states: list[GrammarState]) -> np.ndarray:
    """int32 [len(states), words]: the rows' allowed next tokens, bit ``id % 32`` of word ``id // 32``.
    One call per backend fills its rows, on the backend's own threads: a 128k vocabulary costs
    tens of microseconds a row, which a Python loop would pay one row after another."""
    out = np.empty((len(states), states[0].words), np.int32)
    groups: dict[type, list[int]] = {}
    for i, s in enumerate(states):
        groups.setdefault(type(s.matcher), []).append(i)
    for kind, rows in groups.items():
        kind.fill([states[i].matcher for i in rows], out, rows)
    return out


class GrammarSync:
    """What rank 0 holds of the driver's grammars, so that each thing travels once: each
    backend's vocabulary, each compiled grammar, each request's matcher (its output tokens so
    far, once), and the matchers to drop.  ``reset`` when the ranks are restarted.  Rank 0 keeps
    the newest ``MAX_COMPILED`` grammars it was sent, and so does ``specs`` (``trim_oldest``, at
    the end of a step on both sides): a grammar it let go of is sent again."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.tokenizers: set[str] = set()  # the backends whose vocabulary rank 0 has
        self.specs: dict[StructuredOutputsParams, None] = {}  # oldest first
        self.matchers: set[str] = set()
        self.drops: list[str] = []

    def drop(self, request_id: str) -> None:
        if request_id in self.matchers:
            self.matchers.discard(request_id)
            self.drops.append(request_id)

    def fill(self, si, rows: list[int], reqs: list, counts: list[int] | None = None) -> None:
        """Set ``si``'s grammar fields for the constrained sampling ``rows`` (``reqs`` theirs),
        before this step's placeholders are appended: ``grammar_counts`` are the output tokens
        each row's matcher must have taken before its mask (the newest of them is the row's last
        input token, which rank 0 takes itself when its matcher is one behind).  ``counts``
        overrides them: a speculating request has a row per draft position, the j-th after j
        drafts (spec/decoder.py), and the drafts are no part of the history sent."""
        new, specs, tokenizers = {}, {}, {}
        for r in reqs:
            g = r.grammar
            if r.request_id in self.matchers:
                continue
            if g.spec is None or g.compiler is None:
                raise ValueError(f"request {r.request_id!r}: its GrammarState has no spec to rebuild on rank 0")
            if g.backend not in self.tokenizers:
                tokenizers[g.backend] = g.compiler.tokenizer_payload(g.backend)
                self.tokenizers.add(g.backend)
            if g.spec not in self.specs:
                specs[g.spec] = g.compiler.serialized(g.spec)
                self.specs[g.spec] = None
            # the output so far without the placeholders of tokens still on the ranks (-1);
            # every real id, 0 included, is part of the matcher's history
            out = r.output_token_ids
            new[r.request_id] = (g.spec, [t for t in out[:len(out) - r.num_drafts] if t >= 0])
            self.matchers.add(r.request_id)
        trim_oldest(self.specs)
        si.grammar_rows = np.array(rows, np.int32)
        si.grammar_keys = [r.request_id for r in reqs]
        si.grammar_counts = np.array(counts if counts is not None else
                                     [len(r.token_ids) - r.num_prompt_tokens for r in reqs], np.int32)
        si.grammar_new, si.grammar_specs = new or None, specs or None
        si.grammar_tokenizer = tokenizers or None
        self.take_drops(si)

    def take_drops(self, si) -> None:
        if self.drops:
            si.grammar_drop, self.drops = self.drops, []


def trim_oldest(d: dict, keep: int = MAX_COMPILED) -> None:
    """Drop ``d``'s oldest entries down to ``keep`` (GrammarSync's and rank 0's grammars alike)."""
    for k in list(d)[:max(0, len(d) - keep)]:
        del d[k]
