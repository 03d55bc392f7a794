"""Structured outputs on the OpenAI endpoints: OpenAI's ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs`` and its older ``guided_*`` fields, all read into
one ``StructuredOutputsParams`` and compiled here -- on a worker thread, so neither the HTTP event
loop nor the engine loop waits for a large schema -- before the request reaches the engine.  The
engine then finds the grammar in the compiler's cache, compiled by the app's
``structured_outputs.backend`` (xgrammar, guidance or auto: ``structured_output.GrammarCompiler``).
A spec that does not compile is a 400 naming the field it came in.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Optional

from ray_attn.serve.http import HTTPError
from ray_attn.structured_output import GrammarCompiler, StructuredOutputsParams

_LOCK = threading.Lock()


def _schema_text(schema, field: str) -> str:
    if isinstance(schema, str):
        try:
            json.loads(schema)
        except ValueError as e:
            raise HTTPError(400, [(field, f"{field}: not valid JSON ({e})")]) from None
        return schema
    return json.dumps(schema)


def _spec_kwargs(name: str, value, field: str) -> dict:
    """One spec field as ``StructuredOutputsParams`` takes it: a schema as JSON text, a choice
    as a tuple."""
    if name == "json":
        return {"json": _schema_text(value, field)}
    return {name: tuple(value) if name == "choice" else value}


def structured_spec(req) -> tuple[Optional[StructuredOutputsParams], str]:
    """The request's structured-output spec (None when unconstrained) and the field it came in."""
    found: list[tuple[str, dict]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise HTTPError(400, [("response_format.json_schema", "response_format.json_schema: type "
                                   "json_schema needs json_schema.schema")])
        found.append(("response_format.json_schema.schema",
                      {"json": _schema_text(rf.json_schema.schema_, "response_format.json_schema.schema")}))
    so = req.structured_outputs
    if so is not None:
        for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                            ("grammar", so.grammar)):
            if value is not None:
                field = f"structured_outputs.{name}"
                found.append((field, _spec_kwargs(name, value, field)))
        if so.json_object:
            found.append(("structured_outputs.json_object", {"json_object": True}))
    for name in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{name}")
        if value is not None:
            found.append((f"guided_{name}", _spec_kwargs(name, value, f"guided_{name}")))
    if not found:
        return None, ""
    if len(found) > 1:
        names = ", ".join(f for f, _ in found)
        raise HTTPError(400, [(found[1][0], f"{found[1][0]}: one structured output per request (got {names})")])
    field, kw = found[0]
    try:
        return StructuredOutputsParams(**kw), field
    except ValueError as e:
        raise HTTPError(400, [(field, f"{field}: {str(e).split(': ', 1)[-1]}")]) from None


def grammar_compiler(server) -> GrammarCompiler:
    """The server's compiler (made on first use: building the vocabulary's tables costs ~1 s for a
    128k vocabulary), also handed to its engine."""
    with _LOCK:
        c = getattr(server, "grammar_compiler", None)
        if c is None:
            c = GrammarCompiler(server.tokenizer, server.vocab_size, server.eos_token_ids,
                                backend=server.cfg.structured_outputs.backend)
            server.grammar_compiler = c
            server.engine.grammar_compiler = c
        return c


async def compile_structured(server, spec: Optional[StructuredOutputsParams], field: str) -> None:
    """Compile ``spec`` off the event loop (cached for the engine); a 400 naming ``field`` when it
    cannot be."""
    if spec is None:
        return
    if server.tokenizer is None:
        raise HTTPError(400, [(field, f"{field}: structured outputs need a tokenizer on the server "
                                      f"(app config 'tokenizer')")])
    try:
        await asyncio.to_thread(lambda: grammar_compiler(server).compile(spec, field))
    except ValueError as e:
        raise HTTPError(400, [(field, str(e))]) from None
