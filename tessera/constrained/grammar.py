"""A request's constraint (json_schema, regex or ebnf) as llguidance grammar text, checked once per content.

The library is llguidance (chosen over xgrammar by measurement, docs/benchmarks.md: no compile step to wait
for, a dependency-free abi3 wheel, and every JSON it produced under random logits parsed, where xgrammar let
raw control characters into length-bounded strings). Text is built here, in the frontend, so an invalid
schema or regex is a 400 naming the field before the request reaches the scheduler; the scheduler rebuilds
the same text from the same (kind, source) pair, a cache hit.
"""

from __future__ import annotations

import json
from functools import lru_cache

# SamplingParams fields that constrain decoding, at most one per request.
CONSTRAINT_FIELDS = ("json_schema", "regex", "ebnf")
# A request's JSON is compact: no free whitespace between tokens. With free whitespace a small model can
# emit spaces or newlines until max_tokens (seen on demo-vl), and compact JSON costs fewer tokens.
_JSON_DEFAULTS = {"whitespace_flexible": False}
ANY_JSON_OBJECT = '{"type": "object"}'  # OpenAI's response_format {"type": "json_object"}


@lru_cache(maxsize=512)
def grammar_text(kind: str, source: str) -> str:
    """llguidance's grammar for (kind, source); raises ValueError starting with the field name (`kind`).

    json_schema: a JSON Schema document (text). regex: a full-match regular expression (Rust regex
    syntax: no look-around or back-references). ebnf: GBNF as SGLang/llama.cpp write it (`root ::= ...`)
    or a Lark grammar (`start: ...`).
    """
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    if kind == "json_schema":
        try:
            schema = json.loads(source)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema: not valid JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"json_schema: a schema is a JSON object, got {type(schema).__name__}")
        grammar = LLMatcher.grammar_from_json_schema(no_unlisted_properties(schema), defaults=_JSON_DEFAULTS)
    elif kind == "regex":
        grammar = LLMatcher.grammar_from_regex(source)
    elif kind == "ebnf":
        try:
            grammar = LLMatcher.grammar_from_lark(any_to_lark(source))
        except Exception as e:  # the converter raises bare Exceptions for unknown rules and bad syntax
            raise ValueError(f"ebnf: {e}") from None
    else:
        raise ValueError(f"{kind}: not a constraint (expected one of {', '.join(CONSTRAINT_FIELDS)})")
    problem = LLMatcher.validate_grammar(grammar, None)
    if problem:
        raise ValueError(f"{kind}: {_first_lines(problem)}")
    return grammar


# Keywords whose value is a schema or a list of schemas, and those whose value maps names to schemas.
_SUBSCHEMA = ("items", "prefixItems", "additionalItems", "contains", "additionalProperties", "not", "if", "then",
              "else", "anyOf", "oneOf", "allOf", "unevaluatedItems", "unevaluatedProperties", "propertyNames")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def no_unlisted_properties(schema, inside_all_of: bool = False):
    """A copy of the schema in which an object that lists `properties` and says nothing about others gets
    `additionalProperties: false` (xgrammar's strict mode, SGLang's default, and what OpenAI's strict
    schemas spell out). Every output stays valid against the original schema; without this a small model
    wanders into an invented key whose free string it never closes (seen on demo-vl). Members of allOf
    are left open: they describe one object together."""
    if isinstance(schema, list):
        return [no_unlisted_properties(s, inside_all_of) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if key in schema:
            out[key] = no_unlisted_properties(schema[key], key == "allOf")
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: no_unlisted_properties(sub) for name, sub in schema[key].items()}
    if "properties" in schema and not inside_all_of and not any(k in schema for k in _OPEN_KEYS):
        out["additionalProperties"] = False
    return out


def _first_lines(message: str, limit: int = 400) -> str:
    """llguidance's messages end with a source excerpt; one readable line is enough for an API error."""
    text = " ".join(line.strip() for line in message.strip().splitlines() if line.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."
