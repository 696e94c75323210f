"""/v1/responses over the chat path with the OpenAI SDK: a string and items with an image, instructions,
max_output_tokens, function tools with function_call_output, text.format json_schema, streaming with the
Responses event types, previous_response_id from the bounded store, store: false honoured."""

from __future__ import annotations

import base64
import json

import httpx
import openai
import pytest

from tests.conftest import EXAMPLE_IMAGE

IMAGE = "data:image/png;base64," + base64.b64encode(EXAMPLE_IMAGE.read_bytes()).decode()
TOOLS = [{"type": "function", "name": "count_shapes", "description": "Count shapes", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}]


@pytest.fixture(scope="module")
def client(vl_server):
    return openai.OpenAI(base_url=f"{vl_server.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def test_image_input_items_and_the_same_answer_as_chat(client, vl_server):
    items = [{"role": "user", "content": [{"type": "input_image", "image_url": IMAGE},
                                          {"type": "input_text", "text": "How many shapes are there?"}]}]
    r = client.responses.create(model="demo-vl", input=items, max_output_tokens=8, temperature=0)
    chat = httpx.post(f"{vl_server.base_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE}},
                                                  {"type": "text", "text": "How many shapes are there?"}]}],
        "max_tokens": 8, "temperature": 0}).json()
    assert r.status == "completed" and r.output_text == chat["choices"][0]["message"]["content"] == "three"
    assert r.usage.input_tokens == chat["usage"]["prompt_tokens"]
    as_file = client.responses.create(model="demo-vl", max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_file", "filename": "scene.png", "file_data": IMAGE},
                                     {"type": "input_text", "text": "How many shapes are there?"}]}])
    assert as_file.output_text == "three"
    short = client.responses.create(model="demo-vl", input="Describe a scene.", max_output_tokens=2,
                                    instructions="Be brief.")
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


def test_streaming_events(client):
    events = list(client.responses.create(model="demo-vl", input="How many shapes are there?", stream=True,
                                          max_output_tokens=8, temperature=0))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{events[-1].response.status}" in ("response.completed", "response.incomplete")
    assert "response.output_item.added" in kinds and "response.output_text.done" in kinds
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text and [e.sequence_number for e in events] == list(range(len(events)))


def test_function_tools_round_trip_and_previous_response_id(client):
    first = client.responses.create(model="demo-vl", input="Count the shapes.", tools=TOOLS, max_output_tokens=24,
                                    tool_choice={"type": "function", "name": "count_shapes"}, temperature=0)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "count_shapes" and call.call_id
    follow = client.responses.create(model="demo-vl", previous_response_id=first.id, tools=TOOLS,
                                     max_output_tokens=4, input=[{"type": "function_call_output",
                                                                   "call_id": call.call_id, "output": "3"}])
    assert follow.status in ("completed", "incomplete") and follow.previous_response_id == first.id
    assert client.responses.retrieve(first.id).id == first.id
    unstored = client.responses.create(model="demo-vl", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="demo-vl", input="Hi", previous_response_id=unstored.id, max_output_tokens=2)


def test_json_schema_text_format(client):
    schema = {"type": "object", "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["count"]}
    r = client.responses.create(model="demo-vl", input="How many shapes?", max_output_tokens=16,
                                text={"format": {"type": "json_schema", "name": "shapes", "schema": schema}})
    assert 0 <= json.loads(r.output_text)["count"] <= 9


def test_what_cannot_be_honoured_is_refused_by_name(vl_server):
    url = f"{vl_server.base_url}/v1/responses"
    for body, param in (({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
                        ({"input": "x", "background": True}, "background"),
                        ({"input": [{"type": "mystery"}]}, "input")):
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
