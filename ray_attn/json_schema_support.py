"""What each grammar backend gets right of a JSON schema, and the two repairs we make before
compiling one (``grammar_backends.py`` uses all three):

- ``rfc8259_strings``: xgrammar 0.2.9 compiles a length-bounded string (``minLength`` /
  ``maxLength``, and ``propertyNames`` lengths) to ``[^"\\\\\\r\\n]{0,12}``, which lets the control
  characters U+0000-U+001F through, where its unbounded string rule is ``[^\\0-\\x1f"\\\\\\r\\n]``.
  RFC 8259 section 7 forbids those characters unescaped (``json.loads``: "Invalid control
  character").  Both rules also match the UTF-16 surrogates, as bytes that are not UTF-8.  We
  rewrite the converted EBNF so that every negated character class excludes both -- see the
  function for why that is exactly the string classes.
- ``xgrammar_misses``: the schema keywords xgrammar 0.2.9 accepts and then ignores or reads
  wrongly, so that its output may fail ``jsonschema.validate`` (measured: ``tests/runtime/
  test_grammar_backends.py``'s table, ``MISSED``).  ``auto`` sends such a schema to guidance, which
  either honours the keyword or refuses the schema with a message naming it; an explicit
  ``xgrammar`` backend refuses it (as vLLM's does), rather than answer with JSON the schema rejects.
- ``strict_objects``: xgrammar compiles in strict mode (an object's properties are the ones it
  lists); llguidance follows JSON Schema (more are allowed unless ``additionalProperties`` is
  false).  Closing the objects for guidance gives both backends the same outputs' shape, and every
  output still validates against the schema as given (the closed schema only narrows it).
"""

from __future__ import annotations

import copy

# Keywords xgrammar's converter ignores (the grammar allows what they forbid).
_IGNORED = ("not", "if", "then", "else", "uniqueItems", "contains", "minContains", "maxContains",
            "dependentRequired", "dependentSchemas", "dependencies")
_LENGTH = ("minLength", "maxLength")
# Validation keywords xgrammar drops when the schema is an enum or a const (it emits the values).
_VALUE_CHECKS = ("minLength", "maxLength", "pattern", "format", "minimum", "maximum", "exclusiveMinimum",
                 "exclusiveMaximum", "multipleOf", "minItems", "maxItems", "minProperties", "maxProperties")
# Where a schema holds subschemas: one, a list, or a map of names to subschemas.
_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedProperties", "unevaluatedItems",
        "not", "contains", "propertyNames", "if", "then", "else")
_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def subschemas(schema: dict):
    """(JSON pointer suffix, subschema) of each schema directly inside ``schema``: values of
    ``enum``, ``const``, ``default`` and ``examples`` are data, never visited."""
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            yield f"/{key}", schema[key]
    for key in _LISTS:
        if isinstance(schema.get(key), list):
            for i, s in enumerate(schema[key]):
                if isinstance(s, dict):
                    yield f"/{key}/{i}", s
    for key in _MAPS:
        if isinstance(schema.get(key), dict):
            for name, s in schema[key].items():
                if isinstance(s, dict):
                    yield f"/{key}/{name}", s


def _walk(schema, path=""):
    if isinstance(schema, dict):
        yield path, schema
        for sub, s in subschemas(schema):
            yield from _walk(s, path + sub)


def _misses_here(s: dict) -> list[str]:
    out = [k for k in _IGNORED if k in s]
    for k in ("allOf", "oneOf"):  # allOf: only a single subschema is read; oneOf is read as anyOf
        if isinstance(s.get(k), list) and len(s[k]) > 1:
            out.append(k)
    if "multipleOf" in s and not (s.get("type") == "integer" and isinstance(s["multipleOf"], int)):
        out.append("multipleOf")  # kept only on integers by an integer
    if any(k in s for k in _LENGTH) and any(k in s for k in ("pattern", "format")):
        out.append("minLength/maxLength with pattern or format")  # one of them is kept
    if "pattern" in s and "format" in s:
        out.append("pattern with format")
    if ("enum" in s or "const" in s) and any(k in s for k in _VALUE_CHECKS):
        out.append("enum/const with " + "/".join(k for k in _VALUE_CHECKS if k in s))
    required, props = s.get("required"), s.get("properties") or {}
    if isinstance(required, list) and any(r not in props for r in required) and not s.get("patternProperties"):
        out.append("required names that properties does not list")  # strict mode drops them
    return out


def xgrammar_misses(schema) -> list[str]:
    """``"<JSON pointer>: <keyword>"`` for each place xgrammar 0.2.9 would not honour; [] when it
    honours the whole schema."""
    return [f"{path or '/'}: {k}" for path, s in _walk(schema) for k in _misses_here(s)]


# What a negated class must also exclude: the control characters, and the UTF-16 surrogates,
# which xgrammar's classes (its unbounded string too, and the ``[\\x7f-\\U0010ffff]`` of its
# json-pointer format) otherwise match as the 3-byte sequences ED A0 80-ED BF BF -- not UTF-8
# (RFC 3629), so not JSON text (RFC 8259 section 8.1): a client decodes each as U+FFFD, and a
# maxLength then counts three characters where the grammar counted one.
_EXCLUDED = "\\0-\\x1f\\ud800-\\udfff"
_SURROGATES = (0xD800, 0xDFFF)
_ESCAPES = {"n": 10, "r": 13, "t": 9, "0": 0, "b": 8, "f": 12, "v": 11, "a": 7, "e": 27}


def rfc8259_strings(ebnf: str) -> str:
    """xgrammar's EBNF of a JSON schema with every negated character class also excluding
    U+0000-U+001F and the surrogates U+D800-U+DFFF, and every other class the surrogates.

    Why every negated class, and only those for the control characters: in xgrammar's
    JSON-schema converter the negated classes are exactly the characters of a JSON string (the
    unbounded ``basic_string_sub``, the length-bounded ``*_characters``, ``propertyNames`` keys);
    whitespace, numbers and the ``format`` rules are positive classes, and inside a string those
    never reach below U+0020 (``tests/runtime/test_grammar_backends.py`` walks every format).  A
    JSON string cannot hold the control characters raw (escaped, as ``\\u0001``, it still can),
    and no UTF-8 text holds a surrogate, so this removes no valid output.  Quoted literals (keys,
    enum values, the text of ``Regex("...")``, whose ``json_string=true`` mode escapes on its own)
    are copied untouched: a ``[^`` inside one is text, not a class.

    Rewriting the converted grammar, rather than the schema (a ``pattern`` per bounded string),
    keeps xgrammar's own reading of every keyword and covers each rule that emits a string class,
    including ones a schema rewrite would have to find (property names, nested arrays, $refs)."""
    out, i, n = [], 0, len(ebnf)
    while i < n:
        ch = ebnf[i]
        if ch == '"':  # a literal, to its closing quote
            j = i + 1
            while j < n and ebnf[j] != '"':
                j += 2 if ebnf[j] == "\\" else 1
            out.append(ebnf[i:j + 1])
            i = j + 1
        elif ch == "[":
            ranges, j = _class_ranges(ebnf, i + 1 + (ebnf.startswith("[^", i)))
            if ebnf.startswith("[^", i):
                body = ebnf[i + 2:j]
                out.append("[^" + (body if body.startswith(_EXCLUDED) else _EXCLUDED + body) + "]")
            elif any(lo <= _SURROGATES[1] and hi >= _SURROGATES[0] for lo, hi in ranges):
                out.append("[" + "".join(_range_text(r) for r in _without_surrogates(ranges)) + "]")
            else:
                out.append(ebnf[i:j + 1])
            i = j + 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)


def _class_char(s: str, i: int) -> tuple[int, int]:
    """(code point, index after it) of the class character at ``s[i]``, escapes read."""
    if s[i] != "\\":
        return ord(s[i]), i + 1
    c = s[i + 1]
    digits = {"x": 2, "u": 4, "U": 8}.get(c)
    if digits:
        return int(s[i + 2:i + 2 + digits], 16), i + 2 + digits
    return _ESCAPES.get(c, ord(c)), i + 2


def _class_ranges(s: str, i: int) -> tuple[list[tuple[int, int]], int]:
    """The (lo, hi) ranges of the class body from ``s[i]``, and the index of its closing ``]``."""
    ranges = []
    while s[i] != "]":
        lo, i = _class_char(s, i)
        hi = lo
        if s[i] == "-" and s[i + 1] != "]":
            hi, i = _class_char(s, i + 1)
        ranges.append((lo, hi))
    return ranges, i


def _without_surrogates(ranges):
    a, b = _SURROGATES
    for lo, hi in ranges:
        if lo < a:
            yield lo, min(hi, a - 1)
        if hi > b:
            yield max(lo, b + 1), hi


def _range_text(r: tuple[int, int]) -> str:
    lo, hi = (f"\\U{c:08x}" for c in r)
    return lo if r[0] == r[1] else f"{lo}-{hi}"


def strict_objects(schema):
    """A copy of ``schema`` whose objects with ``properties`` and no word on other keys get
    ``additionalProperties: false`` (xgrammar's strict mode), where every required name is listed."""
    schema = copy.deepcopy(schema)
    for _, s in _walk(schema):
        props = s.get("properties")
        if (isinstance(props, dict) and not any(k in s for k in ("additionalProperties", "patternProperties",
                                                                  "unevaluatedProperties"))
                and all(r in props for r in s.get("required", []) if isinstance(r, str))):
            s["additionalProperties"] = False
    return schema
