"""The request bodies, declared once (tessera/entrypoints/openai/request_models.py): /openapi.json shows each POST
endpoint's body with every field described, the README's example bodies fit the schemas, and the endpoints'
field checks accept exactly the declared fields (an undeclared one is a 400 naming it)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tessera.config import ServerArgs
from tessera.entrypoints.http_server import create_app
from tessera.entrypoints.openai import protocol
from tessera.entrypoints.openai import request_models as rm
from tessera.entrypoints.openai.errors import APIError

README = (Path(__file__).parents[2] / "README.md").read_text()


@pytest.fixture(scope="module")
def spec() -> dict:
    return create_app(ServerArgs.for_engine("demo-vl")).openapi()


def test_every_post_endpoint_documents_its_body_and_every_field(spec) -> None:
    posts = {path: item["post"] for path, item in spec["paths"].items() if "post" in item}
    without_body = {"/flush_cache"}  # takes none
    assert set(posts) - without_body == set(rm.REQUEST_BODIES)
    for path, op in posts.items():
        if path in without_body:
            continue
        (content_type, media), = op["requestBody"]["content"].items()
        schema = media["schema"]
        assert schema.get("additionalProperties") is False, path  # anything undeclared is refused
        undescribed = [name for name, prop in schema["properties"].items() if not prop.get("description")]
        assert not undescribed, f"{path}: fields without a description: {undescribed}"
    chat = posts["/v1/chat/completions"]["requestBody"]["content"]["application/json"]["schema"]
    assert len(chat["properties"]) >= 40 and chat["required"] == ["messages"]


def test_the_readme_examples_fit_the_schemas() -> None:
    curl = re.search(r"curl -s http://127\.0\.0\.1:30000(/v1/chat/completions) .*?-d '(\{.*?\})'\n", README, re.S)
    assert curl, "the README's chat curl example"
    body = json.loads(curl.group(2).replace("'\"$IMG\"'", "AAAA"))
    rm.ChatCompletionRequest.model_validate(body)
    form = re.search(r"curl -s http://127\.0\.0\.1:30000/v1/audio/transcriptions (.*)\n", README).group(1)
    fields = dict(f.split("=", 1) for f in re.findall(r"-F (\S+)", form))
    rm.TranscriptionRequest.model_validate({**fields, "file": b"RIFF"})
    # The structured-output example's arguments, as the OpenAI client sends them.
    rm.ChatCompletionRequest.model_validate({
        "model": "demo-vl", "temperature": 0, "max_tokens": 64,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:..."}},
                                                   {"type": "text", "text": "How many shapes are there?"}]}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "scene", "schema": {}}}})
    with pytest.raises(ValueError, match="max_tokenz"):
        rm.ChatCompletionRequest.model_validate({"messages": [], "max_tokenz": 3})


@pytest.mark.parametrize(("model", "accepted"), [(rm._ChatFields, protocol.CHAT_FIELDS),
                                                 (rm._CompletionFields, protocol.COMPLETION_FIELDS)])
def test_the_field_checks_take_exactly_the_declared_fields(model, accepted) -> None:
    for name in model.model_fields:
        protocol.check_fields({name: None}, accepted)  # declared (honoured, or refused only past its no-op)
    with pytest.raises(APIError, match="^undeclared_field: unknown parameter"):
        protocol.check_fields({"undeclared_field": 1}, accepted)
