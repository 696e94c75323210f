"""The request bodies, declared once (tessera/entrypoints/openai/request_models.py) and parsed at the edge:
/openapi.json shows each POST endpoint's body with every field described and its answers' schemas, the README's
example bodies fit the schemas, a bad body is a 400 naming the field, and real answers fit their documented
shapes (response_models.py), through the real app with a stand-in scheduler (tests/server/stub_app.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tessera.config import ServerArgs
from tessera.entrypoints.http_server import create_app
from tessera.entrypoints.openai import request_models as rm
from tessera.entrypoints.openai import response_models as answers
from tessera.entrypoints.openai.errors import APIError

README = (Path(__file__).parents[2] / "README.md").read_text()
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def spec() -> dict:
    return create_app(ServerArgs.for_engine("demo-vl")).openapi()


@pytest.fixture(scope="module")
def client():
    from tests.server.stub_app import stub_client

    with stub_client() as c:
        yield c


def _posts(spec: dict) -> dict:
    return {path: item["post"] for path, item in spec["paths"].items() if "post" in item and path != "/flush_cache"}


def test_every_post_endpoint_documents_its_body_and_every_field(spec) -> None:
    posts = _posts(spec)
    assert set(posts) == set(rm.REQUEST_BODIES)  # /flush_cache takes no body
    counts = {}
    for path, op in posts.items():
        (content_type, media), = op["requestBody"]["content"].items()
        schema = media["schema"]
        assert schema.get("additionalProperties") is False, path  # anything undeclared is refused
        undescribed = [name for name, prop in schema["properties"].items() if not prop.get("description")]
        assert not undescribed, f"{path}: fields without a description: {undescribed}"
        assert "$ref" not in json.dumps(schema), path  # nested models are written in place
        counts[path] = len(schema["properties"])
    chat = posts["/v1/chat/completions"]["requestBody"]["content"]["application/json"]["schema"]
    assert counts["/v1/chat/completions"] >= 40 and chat["required"] == ["messages"]
    assert chat["properties"]["stream_options"]["anyOf"][0]["properties"]["include_usage"]["description"]


def test_every_post_endpoint_documents_its_answers(spec) -> None:
    components = spec["components"]["schemas"]
    for path, op in _posts(spec).items():
        ok = op["responses"]["200"]["content"]["application/json"]["schema"]
        assert components[ok["$ref"].split("/")[-1]]["properties"], path
        error = op["responses"]["400"]["content"]["application/json"]["schema"]
        assert error["$ref"].endswith("/ErrorResponse"), path
    for path in ("/v1/chat/completions", "/v1/completions", "/generate"):
        event = _posts(spec)[path]["responses"]["200"]["content"]["text/event-stream"]["schema"]
        assert "choices" in event["properties"] or "meta_info" in event["properties"], path
    models = spec["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert models["$ref"].endswith("/ModelList")


def test_the_readme_examples_fit_the_schemas() -> None:
    curl = re.search(r"curl -s http://127\.0\.0\.1:30000(/v1/chat/completions) .*?-d '(\{.*?\})'\n", README, re.S)
    assert curl, "the README's chat curl example"
    body = json.loads(curl.group(2).replace("'\"$IMG\"'", "AAAA"))
    rm.parse(rm.ChatCompletionRequest, body)
    form = re.search(r"curl -s http://127\.0\.0\.1:30000/v1/audio/transcriptions (.*)\n", README).group(1)
    fields = dict(f.split("=", 1) for f in re.findall(r"-F (\S+)", form))
    rm.TranscriptionRequest.model_validate({**fields, "file": b"RIFF"})
    # The structured-output example's arguments, as the OpenAI client sends them.
    rm.parse(rm.ChatCompletionRequest, {
        "model": "demo-vl", "temperature": 0, "max_tokens": 64,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:..."}},
                                                   {"type": "text", "text": "How many shapes are there?"}]}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "scene", "schema": {}}}})


@pytest.mark.parametrize(("model", "body", "message"), [
    (rm.ChatCompletionRequest, {"messages": USER, "max_tokenz": 3}, "max_tokenz: unknown parameter"),
    (rm.ChatCompletionRequest, {"messages": USER, "stream": "yes"}, "stream: Input should be a valid boolean"),
    (rm.ChatCompletionRequest, {"messages": USER, "n": 2.0}, "n: Input should be a valid integer, got 2.0"),
    (rm.ChatCompletionRequest, {"messages": USER, "stop": 5}, "stop: Input should be a valid string; or "),
    (rm.ChatCompletionRequest, {"messages": USER, "stop_token_ids": [1, True]}, "stop_token_ids[1]: "),
    (rm.ChatCompletionRequest, {"messages": USER, "stream": True, "stream_options": {"usage": True}},
     "stream_options.usage: unknown field"),
    (rm.ChatCompletionRequest, {"messages": USER, "use_beam_search": True}, "use_beam_search: beam search"),
    (rm.GenerateRequest, {"text": "hi", "lora_id": "a"}, "lora_id: name the LoRA adapter with lora_path"),
    (rm.ChatCompletionRequest, {"model": "x"}, "messages: Field required"),
    (rm.CompletionRequest, {"prompt": ["a", 1]}, "prompt: "),
    (rm.GenerateRequest, {"text": "hi", "modalities": ["smell"]}, "modalities[0]: Input should be 'image'"),
    (rm.GenerateRequest, {"text": "hi", "cache_salt": ""}, "cache_salt: String should have at least 1"),
    (rm.DetokenizeRequest, {"tokens": [1, "2"]}, "tokens[1]: Input should be a valid integer"),
])
def test_a_bad_body_is_a_400_naming_the_field(model, body, message) -> None:
    with pytest.raises(APIError) as e:
        rm.parse(model, body)
    assert e.value.status == 400 and e.value.message.startswith(message), e.value.message
    assert e.value.param == re.split(r"[.:\[]", message, maxsplit=1)[0]


@pytest.mark.parametrize("model", [rm.ChatCompletionRequest, rm.CompletionRequest, rm.GenerateRequest])
def test_every_declared_field_is_taken_at_null_and_peers_fields_at_their_no_op_values(model) -> None:
    required = {name: {"messages": USER, "prompt": "hi"}[name] for name, f in model.model_fields.items()
                if f.is_required()}
    for name in model.model_fields:
        rm.parse(model, {**required, name: required.get(name)})
    for name, (noops, _) in model.noops.items():
        for value in noops:
            assert getattr(rm.parse(model, {**required, name: value}), name) == value


def _events(r) -> list[dict]:
    lines = [x.removeprefix("data: ") for x in r.text.split("\n") if x.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines
    return [json.loads(x) for x in lines[:-1]]


def test_answers_fit_their_documented_schemas(client) -> None:
    """Every key the endpoints send is documented (the answer models forbid others) and typed as sent."""
    chat = {"messages": USER, "max_tokens": 1, "logprobs": True, "top_logprobs": 1}
    answers.ChatCompletionResponse.model_validate(client.post("/v1/chat/completions", json=chat).json())
    stream = client.post("/v1/chat/completions", json={**chat, "stream": True,
                                                       "stream_options": {"include_usage": True}})
    for event in _events(stream):
        answers.ChatCompletionChunk.model_validate(event)
    completion = {"prompt": "hi", "max_tokens": 1, "logprobs": 1, "echo": True}
    answers.CompletionResponse.model_validate(client.post("/v1/completions", json=completion).json())
    for event in _events(client.post("/v1/completions", json={**completion, "stream": True})):
        answers.CompletionResponse.model_validate(event)
    generate = {"text": ["hi", "ho"], "sampling_params": {"max_new_tokens": 1}, "return_logprob": True}
    for one in client.post("/generate", json=generate).json():
        answers.GenerateResponse.model_validate(one)
    answers.TokenizeResponse.model_validate(client.post("/tokenize", json={"prompt": "hi"}).json())
    answers.DetokenizeResponse.model_validate(client.post("/detokenize", json={"tokens": [11]}).json())
    answers.ModelList.model_validate(client.get("/v1/models").json())
    bad = client.post("/v1/chat/completions", json={"messages": USER, "temprature": 1})
    assert bad.status_code == 400
    err = answers.ErrorResponse.model_validate(bad.json()).error
    assert err.param == "temprature" and err.message == "temprature: unknown parameter"
