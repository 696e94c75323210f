"""Structured output through `tessera serve` on demo-vl, driven by the openai client: every answer parses
and validates (the tiny model alone never writes JSON), in every request shape the server accepts."""

from __future__ import annotations

import base64
import json
import re

import httpx
import openai
import pytest

from tessera.config import ASSETS_DIR
from tests.constrained.scene_schema import ANSWER_REGEX, SCENE_SCHEMA, validate_scene

IMAGE_URI = "data:image/png;base64," + base64.b64encode((ASSETS_DIR / "examples" / "scene.png").read_bytes()).decode()
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "scene", "schema": SCENE_SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def server(vl_server):
    """The session's demo-vl server (16,384 KV tokens; its tool template renders like demo-vl's without tools)."""
    return vl_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", timeout=120, max_retries=0)


def scene_messages(question: str = "How many shapes are there, and what colors are they?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE_URI}},
                                         {"type": "text", "text": question}]}]


def test_json_schema_answers_parse_and_validate_greedy_and_sampled(client):
    greedy = client.chat.completions.create(model="demo-vl", messages=scene_messages(), response_format=RESPONSE_FORMAT,
                                            temperature=0, max_tokens=64)
    sampled = client.chat.completions.create(model="demo-vl", messages=scene_messages("Describe the image."),
                                             response_format=RESPONSE_FORMAT, temperature=1.0, n=4, seed=3,
                                             max_tokens=64)
    for choice in [*greedy.choices, *sampled.choices]:
        assert choice.finish_reason == "stop", choice
        validate_scene(json.loads(choice.message.content))
        assert " " not in choice.message.content  # compact JSON


def test_regex_in_the_body_matches_and_streams_the_same_text(client):
    kw = dict(model="demo-vl", messages=scene_messages("Describe the image."), temperature=0, max_tokens=32,
              extra_body={"regex": ANSWER_REGEX})
    full = client.chat.completions.create(**kw).choices[0]
    assert re.fullmatch(ANSWER_REGEX, full.message.content), full.message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == full.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_max_tokens_before_the_grammar_ends_is_length_with_the_prefix(client):
    full = client.chat.completions.create(model="demo-vl", messages=scene_messages(), response_format=RESPONSE_FORMAT,
                                          temperature=0, max_tokens=64).choices[0].message.content
    short = client.chat.completions.create(model="demo-vl", messages=scene_messages(), response_format=RESPONSE_FORMAT,
                                           temperature=0, max_tokens=3).choices[0]
    assert short.finish_reason == "length" and full.startswith(short.message.content) and short.message.content


def test_stop_string_inside_the_json_cuts_it(client):
    out = client.chat.completions.create(model="demo-vl", messages=scene_messages(), response_format=RESPONSE_FORMAT,
                                         temperature=0, max_tokens=64, stop=['"colors"']).choices[0]
    assert out.finish_reason == "stop" and out.message.content.startswith('{"count":') and "colors" not in \
        out.message.content


def test_completions_json_object_and_native_generate_ebnf(server, client):
    comp = client.completions.create(model="demo-vl", prompt="<|im_start|>user\nCount the shapes.<|im_end|>\n"
                                     "<|im_start|>assistant\n", max_tokens=48, temperature=0,
                                     extra_body={"response_format": {"type": "json_object"}})
    assert isinstance(json.loads(comp.choices[0].text), dict)
    body = {"text": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Is there a red circle?<|im_end|>\n"
                    "<|im_start|>assistant\n", "image_data": IMAGE_URI,
            "sampling_params": {"ebnf": 'root ::= ("yes" | "no") "."', "temperature": 0, "max_new_tokens": 8}}
    out = httpx.post(f"{server.base_url}/generate", json=body, timeout=60).json()
    assert out["text"] in ("yes.", "no."), out


@pytest.mark.parametrize(("extra", "param", "needle"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "response_format"),
    ({"regex": "(unclosed"}, "regex", "regex"),
    ({"ebnf": "root ::= missing_rule"}, "ebnf", "ebnf"),
    ({"response_format": {"type": "yaml"}}, "response_format", "response_format.type"),
])
def test_invalid_constraints_are_400_naming_the_field(server, client, extra, param, needle):
    body = {"model": "demo-vl", "messages": scene_messages(), "max_tokens": 8, **extra}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and needle in err["message"], err
    r = httpx.post(f"{server.base_url}/generate", json={"text": "hi", "sampling_params": {"regex": "a(b"}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "regex"
    # The server keeps serving constrained requests after the errors.
    ok = client.chat.completions.create(model="demo-vl", messages=scene_messages(), extra_body={"regex": "(yes|no)"},
                                        temperature=0, max_tokens=4)
    assert ok.choices[0].message.content in ("yes", "no")


def test_lang_examples_run_against_the_server(server):
    """tessera.RuntimeEndpoint: the same programs over HTTP (media sent as data URIs, prefilled answers as
    continue_final_message), with the results the Engine gives."""
    from examples import lang_fork_and_batch, lang_multi_turn, lang_structured

    turns = lang_multi_turn.main(server.base_url)
    assert turns["description"] == "a red circle, a blue square and a green triangle"
    assert turns["circle_color"] == "red" and turns["cached_tokens_last_turn"] > 100
    validate_scene(lang_structured.main(server.base_url)["scene"])
    assert lang_fork_and_batch.main(server.base_url)["batch"][1] == "a green circle moving up"


def test_lang_streams_over_http(server):
    import tessera

    @tessera.function
    def describe(s):
        s += tessera.user(tessera.image(IMAGE_URI) + "Describe the image.")
        s += tessera.assistant(tessera.gen("d", max_tokens=32, temperature=0, regex=ANSWER_REGEX))

    state = describe.run(backend=tessera.RuntimeEndpoint(server.base_url), stream=True)
    pieces = list(state.text_iter("d"))
    assert len(pieces) > 1 and "".join(pieces) == state["d"]
    assert re.fullmatch(ANSWER_REGEX, state["d"]) and state.get_meta_info("d")["finish_reason"] == "stop"
