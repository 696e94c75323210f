"""OpenAI `response_format` and SGLang's `regex` / `ebnf` / `json_schema` body fields -> SamplingParams fields.

    {"type": "text"}                                      free text (the default)
    {"type": "json_object"}                               any JSON object
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
                                                          JSON valid against the schema

Output is always constrained to the schema (as OpenAI's strict mode); `strict` is accepted and not needed.
Every problem is an APIError naming the field, checked here so a bad schema or regex is a 400 before any work.
"""

from __future__ import annotations

import json
from typing import Any

from tessera.constrained.grammar import ANY_JSON_OBJECT, CONSTRAINT_FIELDS, grammar_text
from tessera.entrypoints.openai.errors import APIError


def constraint_from_openai(body: dict) -> dict[str, str]:
    """{SamplingParams field: source} for the request's constraint; {} when decoding is free."""
    found: dict[str, tuple[str, str]] = {}  # field -> (source, the body field it came from)
    for name in CONSTRAINT_FIELDS:
        value = body.get(name)
        if value is None:
            continue
        if name == "json_schema" and isinstance(value, dict):
            value = json.dumps(value)
        if not isinstance(value, str) or not value:
            raise APIError(f"{name}: must be a non-empty string", param=name)
        found[name] = (value, name)
    fmt = body.get("response_format")
    if fmt is not None:
        schema = _schema_of_response_format(fmt)
        if schema is not None:
            if "json_schema" in found:
                raise APIError("response_format: give either response_format or json_schema, not both",
                               param="response_format")
            found["json_schema"] = (schema, "response_format")
    if len(found) > 1:
        names = [origin for _, origin in found.values()]
        raise APIError(f"{names[1]}: only one output constraint per request, got {', '.join(names)}", param=names[1])
    for name, (source, origin) in found.items():
        try:
            grammar_text(name, source)
        except ValueError as e:
            message = str(e)
            if origin != name:  # say which field the user wrote
                message = f"{origin}: {message.split(': ', 1)[1] if ': ' in message else message}"
            raise APIError(message, param=origin) from None
    return {name: source for name, (source, _) in found.items()}


def _schema_of_response_format(fmt: Any) -> str | None:
    if not isinstance(fmt, dict):
        raise APIError("response_format: must be an object with a type", param="response_format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_JSON_OBJECT
    if kind != "json_schema":
        raise APIError(f"response_format.type: must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                       param="response_format")
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise APIError("response_format.json_schema: must be an object with a name and a schema",
                       param="response_format")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise APIError("response_format.json_schema.name: must be a string", param="response_format")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise APIError("response_format.json_schema.strict: must be a boolean", param="response_format")
    schema = spec.get("schema")
    if schema is None:  # OpenAI allows leaving it out: any JSON object
        return ANY_JSON_OBJECT
    if not isinstance(schema, (dict, bool)):
        raise APIError("response_format.json_schema.schema: must be a JSON Schema object", param="response_format")
    return json.dumps(schema)
