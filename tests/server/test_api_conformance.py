"""OpenAI/SGLang/vLLM request shapes against one demo-vl server: every case either works as those
servers' own tests expect, or is refused with a 400 in OpenAI's error shape that names the field.
Requests are short (a few tokens each); the server is the session's (tests/server/conftest.py)."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx
import openai
import pytest

from tessera.entrypoints.openai.errors import APIError
from tessera.entrypoints.openai.request_models import ChatCompletionRequest, parse
from tessera.entrypoints.openai.streaming import event_stream
from tessera.entrypoints.openai.tool_calls import (
    ToolCallParser,
    ToolPlan,
    parse_tool_calls,
    plan_tools,
)
from tessera.frontend.tokenizer_manager import EngineUnavailable
from tests.server.conftest import EXAMPLE_VIDEO, TOOL_TEMPLATE
from tests.server.server_process import wait_until_idle

USER = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def base(vl_server) -> str:
    return vl_server.base_url


@pytest.fixture(scope="module")
def client(vl_server):
    return openai.OpenAI(base_url=f"{vl_server.base_url}/v1", api_key="unused", timeout=60, max_retries=0)


def chat(base: str, **body) -> httpx.Response:
    body.setdefault("messages", USER)
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)


def assert_400(r: httpx.Response, param: str | None, needle: str = "") -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == 400 and err["type"] == "invalid_request_error", err
    if param is not None:
        assert err["param"] == param, err
    assert needle in err["message"], err


def stats(base: str) -> dict:
    return httpx.get(f"{base}/get_server_info", timeout=30).json()["stats"]


# ---- broken streams and leaks -------------------------------------------------------------------
@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url",
                                                 "image_url": {"url": "data:image/png;base64,!!"}}]}]}, None),
    ({"messages": USER, "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"messages": USER, "max_tokens": 10**6}, "max_tokens"),
])
def test_stream_validation_errors_come_before_the_first_byte(base, client, body, param):
    with httpx.Client(timeout=60) as c:  # one connection: it must stay usable after the error
        r = c.post(f"{base}/v1/chat/completions", json={**body, "stream": True})
        assert_400(r, param)
        ok = c.post(f"{base}/v1/chat/completions", json={"messages": USER, "max_tokens": 2})
        assert ok.status_code == 200
    with pytest.raises(openai.BadRequestError):
        for _ in client.chat.completions.create(model="demo-vl", stream=True, **body):
            pass


def test_error_after_the_first_byte_is_an_sse_error_then_done():
    def events_of(exc: Exception) -> list[str]:
        async def failing():
            yield 'data: {"choices": []}\n\n'
            raise exc

        async def body() -> str:
            return "".join([c async for c in event_stream(failing()).body_iterator])

        return [e.removeprefix("data: ") for e in asyncio.run(body()).split("\n\n") if e]

    events = events_of(EngineUnavailable("the scheduler process has exited"))
    assert events[-1] == "[DONE]" and json.loads(events[0]) == {"choices": []}
    err = json.loads(events[-2])["error"]
    assert err == {"message": "the scheduler process has exited", "type": "service_unavailable", "param": None,
                   "code": 503}
    err = json.loads(events_of(RuntimeError("/secret/path/model.py line 3"))[-2])["error"]
    assert "secret" not in err["message"] and err["code"] == 500 and err["type"] == "server_error"


def test_non_streaming_disconnect_aborts_and_frees_kv(base, vl_server):
    before = stats(base)["num_forward_steps"]
    with pytest.raises(httpx.TimeoutException):  # no max_tokens: the whole context (~4000 steps) unless aborted
        httpx.post(f"{base}/v1/chat/completions", json={"messages": USER, "ignore_eos": True}, timeout=1.0)
    s = wait_until_idle(base)
    assert s["num_running"] == 0 and s["kv_used_tokens"] == 0, s
    assert s["num_forward_steps"] - before < 2000, "the abandoned request ran on"
    assert "Exception in ASGI application" not in vl_server.output()  # an abort is not an error


# ---- shapes and statuses ------------------------------------------------------------------------
def test_models_routes_unknown_routes_and_flush_cache(base, client):
    model = client.models.retrieve("demo-vl")
    assert model.id == "demo-vl" and model.root == "demo-vl"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    for method, path in (("POST", "/v1/images/generations"), ("POST", "/v1/no/such/route"),
                         ("GET", "/v1/chat/completions")):
        r = httpx.request(method, f"{base}{path}", json={}, timeout=30)
        assert r.status_code in (404, 405) and r.json()["error"]["code"] == r.status_code, r.text
    assert httpx.get(f"{base}/flush_cache", timeout=30).status_code == 200
    assert httpx.post(f"{base}/flush_cache", timeout=30).status_code == 200


def test_max_tokens_beyond_the_context_is_400_with_the_numbers(base, client):
    ctx = client.models.list().data[0].max_model_len
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo-vl", messages=USER, max_tokens=ctx)
    assert f"context length is {ctx}" in str(e.value) and "max_tokens" in str(e.value)
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": USER, "max_completion_tokens": ctx}, timeout=30)
    assert_400(r, "max_completion_tokens", str(ctx))


def test_completions_logprobs_token_prompts_and_echo(base, client):
    comp = client.completions.create(model="demo-vl", prompt="Hello", max_tokens=3, logprobs=0, temperature=0)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == 3
    assert all(len(top) == 1 for top in lp.top_logprobs)
    assert lp.text_offset == [0, len(lp.tokens[0]), len(lp.tokens[0]) + len(lp.tokens[1])]
    batch = client.completions.create(model="demo-vl", prompt=[[1, 2, 3], [4, 5]], max_tokens=2, temperature=0)
    assert len(batch.choices) == 2 and batch.usage.prompt_tokens == 5
    echoed = client.completions.create(model="demo-vl", prompt=[9, 10], max_tokens=2, echo=True, temperature=0)
    plain = client.completions.create(model="demo-vl", prompt=[9, 10], max_tokens=2, temperature=0)
    assert echoed.choices[0].text.endswith(plain.choices[0].text) and len(echoed.choices[0].text) > len(
        plain.choices[0].text)
    chunks = list(client.completions.create(model="demo-vl", prompt="Hello", max_tokens=3, echo=True,
                                            temperature=0, stream=True))
    assert chunks[0].choices[0].text == "Hello"
    streamed = list(client.completions.create(model="demo-vl", prompt="Hello", max_tokens=3, logprobs=2,
                                              temperature=0, stream=True))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_native_generate_takes_sglang_fields(base):
    r = httpx.post(f"{base}/generate", timeout=60, json={
        "text": ["Hello", "Hi there"], "sampling_params": {"max_new_tokens": 2, "temperature": 0},
        "return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True, "logprob_start_len": -1,
        "modalities": ["image"]})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert [o["index"] for o in outs] == [0, 1]
    for out in outs:
        meta = out["meta_info"]
        assert [t for _, t, _ in meta["output_token_logprobs"]] == out["output_ids"]
        for (lp, tid, text), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
            assert len(top) == 2 and top[0][1] == tid and top[0][0] == pytest.approx(lp) and isinstance(text, str)
    ids = httpx.post(f"{base}/generate", timeout=60, json={
        "input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"max_new_tokens": 1}, "stream": False}).json()
    assert len(ids) == 2
    assert_400(httpx.post(f"{base}/generate", timeout=30, json={"text": "Hi", "return_logprob": True,
                                                                "logprob_start_len": "0"}), "logprob_start_len")
    lines = []
    with httpx.stream("POST", f"{base}/generate", timeout=60, json={
            "text": "Hi", "stream": True, "sampling_params": {"max_new_tokens": 3}}) as s:
        lines = [ln for ln in s.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[-2][6:])["meta_info"]["finish_reason"] is not None


def test_matched_stop_is_reported(client):
    reply = client.completions.create(model="demo-vl", prompt="Hello", max_tokens=8, temperature=0)
    text = reply.choices[0].text
    stopped = client.completions.create(model="demo-vl", prompt="Hello", max_tokens=8, temperature=0, stop=[text[1:3]])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].model_extra["matched_stop"] == text[1:3]


@pytest.mark.parametrize("path,body,param", [
    ("chat", {"n": 0}, "n"),
    ("chat", {"max_tokens": -1}, "max_tokens"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ("chat", {"regex": "[a-z"}, "regex"),
    ("chat", {"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    ("chat", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("chat", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("chat", {"use_beam_search": True}, "use_beam_search"),
    ("chat", {"frobnicate": 1}, "frobnicate"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "http://x/y.png"}]}]},
     "messages.content.image_url"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": "x.mp4"}]}]},
     "messages.content.video_url"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "audio_url", "audio_url": "x.wav"}]}]},
     "messages.content.audio_url"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("chat", {"seed": 2**63}, "seed"),
    ("chat", {"logit_bias": {"not-a-token": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"5": 500}}, "logit_bias"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("chat", {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ("chat", {"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
    ("chat", {"media_io_kwargs": {"video": {"num_frames": 0}}}, "media_io_kwargs"),
    ("chat", {"cache_salt": ""}, "cache_salt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
    ("completions", {"prompt": "hi", "best_of": 3}, "best_of"),
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
])
def test_refused_or_invalid_parameters_are_400_naming_them(base, path, body, param):
    if path == "chat":
        body = {"messages": USER, **body}
    r = httpx.post(f"{base}/v1/{'chat/completions' if path == 'chat' else 'completions'}", json=body, timeout=30)
    assert_400(r, param)


def test_a_json_body_with_a_form_content_type_is_400(base):
    r = httpx.post(f"{base}/v1/chat/completions", content=json.dumps({"messages": USER}), timeout=30,
                   headers={"content-type": "application/x-www-form-urlencoded"})
    assert_400(r, "Content-Type")


# ---- parameters that used to be ignored ---------------------------------------------------------
def test_logit_bias_forces_and_bans_tokens(base, client):
    def generate(bias=None) -> list[int]:
        sp = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True, **({"logit_bias": bias} if bias else {})}
        return httpx.post(f"{base}/generate", json={"text": "Hello", "sampling_params": sp}, timeout=30).json()[
            "output_ids"]

    greedy = generate()
    forced = (greedy[0] + 7) % 300 + 10
    assert generate({str(forced): 100}) == [forced] * 3
    assert generate({str(greedy[0]): -100})[0] != greedy[0]
    via_openai = client.completions.create(model="demo-vl", prompt="Hello", max_tokens=3, temperature=0,
                                           logit_bias={str(forced): 100}, logprobs=0)
    assert len(set(via_openai.choices[0].logprobs.tokens)) == 1
    reply = client.chat.completions.create(model="demo-vl", messages=USER, max_tokens=2, temperature=0,
                                           logit_bias={str(forced): 100})
    assert reply.choices[0].finish_reason == "length"


def test_cache_salt_isolates_prefix_cache_entries(client):
    words = " ".join(uuid.uuid4().hex for _ in range(12))  # a prompt no earlier test cached

    def cached(**extra) -> int:
        reply = client.chat.completions.create(model="demo-vl", messages=[{"role": "user", "content": words}],
                                               max_tokens=1, extra_body=extra)
        return reply.usage.prompt_tokens_details.cached_tokens

    cached()
    assert cached() > 0  # unsalted requests share
    assert cached(cache_salt="alice") == 0
    assert cached(cache_salt="alice") > 0
    assert cached(cache_salt="bob") == 0


def test_continuous_usage_stats(client):
    chunks = list(client.chat.completions.create(
        model="demo-vl", messages=USER, max_tokens=4, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None and c.usage.prompt_tokens > 0 for c in chunks), "every chunk carries usage"
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == 4
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    plain = list(client.chat.completions.create(model="demo-vl", messages=USER, max_tokens=2, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 2


def test_media_io_kwargs_num_frames_changes_the_video(client, vl_media_dir):
    def prompt_tokens(frames: int) -> int:
        content = [{"type": "video_url", "video_url": {"url": str(vl_media_dir / EXAMPLE_VIDEO.name)}},
                   {"type": "text", "text": "What moves?"}]
        reply = client.chat.completions.create(model="demo-vl", messages=[{"role": "user", "content": content}],
                                               max_tokens=1, extra_body={"media_io_kwargs": {"video": {"num_frames": frames}}})
        return reply.usage.prompt_tokens

    assert prompt_tokens(8) > prompt_tokens(2)


def test_custom_roles_reach_the_template(client):
    messages = [{"role": "my-custom-role", "content": "Name a shape."}, {"role": "user", "content": "Go on."}]
    reply = client.chat.completions.create(model="demo-vl", messages=messages, max_tokens=2)
    assert reply.usage.prompt_tokens > 10


def test_continue_final_message_and_chat_echo(client):
    messages = [{"role": "user", "content": "Name a shape."}, {"role": "assistant", "content": "The shape is"}]
    reply = client.chat.completions.create(model="demo-vl", messages=messages, max_tokens=2, temperature=0,
                                           extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                                       "echo": True})
    assert reply.choices[0].message.content.startswith("The shape is")
    fresh = client.chat.completions.create(model="demo-vl", messages=messages[:1], max_tokens=2, temperature=0,
                                           extra_body={"add_generation_prompt": False, "echo": True})
    assert not fresh.choices[0].message.content.startswith("Name a shape.")  # echo repeats only the assistant's


# ---- tool calling ---------------------------------------------------------------------------------
def test_named_tool_choice_returns_that_call_streamed_or_not(client):
    kw = dict(model="demo-vl", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=TOOLS,
              max_tokens=12, temperature=0, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    reply = client.chat.completions.create(**kw)
    calls = reply.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"] and calls[0].id.startswith("call_")
    name, args, ids = "", "", set()
    for chunk in client.chat.completions.create(stream=True, **kw):
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            assert delta.index == 0
            ids.add(delta.id) if delta.id else None
            name += delta.function.name or "" if delta.function else ""
            args += delta.function.arguments or "" if delta.function else ""
    assert name == "get_weather" and args == calls[0].function.arguments and len(ids) == 1
    if reply.choices[0].finish_reason == "stop":  # constrained to the function's parameters
        assert "city" in json.loads(args)


def test_required_tool_choice_is_a_valid_call_of_one_of_the_tools(client):
    tools = TOOLS + [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
    for n in range(2):
        reply = client.chat.completions.create(model="demo-vl", messages=[{"role": "user", "content": "Time?"}],
                                               tools=tools, tool_choice="required", max_tokens=40, seed=n,
                                               temperature=1.0)
        choice = reply.choices[0]
        if choice.finish_reason == "length":  # a free string may run to max_tokens; the shape is all we judge
            continue
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0].function
        args = json.loads(call.arguments)  # constrained: always valid JSON of that function's parameters
        assert call.name in ("get_weather", "get_time")
        assert ("city" in args) if call.name == "get_weather" else args["zone"] in ("UTC", "CET")


def test_tool_choice_auto_none_and_a_tool_round_trip(client):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    auto = client.chat.completions.create(model="demo-vl", messages=messages, tools=TOOLS, max_tokens=8)
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")
    none = client.chat.completions.create(model="demo-vl", messages=messages, tools=TOOLS, tool_choice="none",
                                          max_tokens=4)
    assert none.choices[0].message.tool_calls is None
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    follow = client.chat.completions.create(model="demo-vl", messages=history, tools=TOOLS, max_tokens=4)
    assert follow.choices[0].finish_reason is not None


def test_tool_call_parser_whole_and_streamed():
    plan = ToolPlan(TOOLS, "auto")
    text = ('Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    content, calls = parse_tool_calls(text, plan)
    assert content == "Let me check." and [json.loads(c["function"]["arguments"])["city"] for c in calls] == [
        "Paris", "Rome"]
    parser, streamed_content, streamed = ToolCallParser(), "", []
    for ch in text:  # one character at a time: "<tool_call>" never leaks into content
        c, done = parser.feed(ch)
        streamed_content += c
        streamed += done
    assert streamed_content == content and [c["function"] for c in streamed] == [c["function"] for c in calls]
    assert parse_tool_calls("<tool_call>{not json}</tool_call>", plan) == ("<tool_call>{not json}</tool_call>", [])
    _, open_call = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}', plan)  # EOS before the close tag
    assert open_call[0]["function"] == {"name": "f", "arguments": "{}"}
    single = ToolPlan(TOOLS, "auto", parallel=False)
    assert len(parse_tool_calls(text, single)[1]) == 1


def test_templates_without_tool_support_refuse_tools():
    stock = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    def req(**body):
        return parse(ChatCompletionRequest, {"messages": USER, **body})

    with pytest.raises(APIError) as e:
        plan_tools(req(tools=TOOLS), stock)
    assert e.value.param == "tools" and e.value.status == 400
    assert plan_tools(req(tools=TOOLS, tool_choice="none"), stock) is None
    assert plan_tools(req(tools=TOOLS), TOOL_TEMPLATE.read_text()).choice == "auto"


def test_sglang_and_vllm_utility_routes(base):
    tokens = httpx.post(f"{base}/tokenize", json={"prompt": "Hello world"}, timeout=30).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] > 0
    back = httpx.post(f"{base}/detokenize", json={"tokens": tokens["tokens"]}, timeout=30).json()
    assert back["prompt"] == "Hello world"
    chat_tokens = httpx.post(f"{base}/tokenize", json={"messages": USER}, timeout=30).json()
    usage = httpx.post(f"{base}/v1/chat/completions", json={"messages": USER, "max_tokens": 1}, timeout=30).json()
    assert chat_tokens["count"] == usage["usage"]["prompt_tokens"]
    assert_400(httpx.post(f"{base}/detokenize", json={"tokens": [-1]}, timeout=30), "tokens")
    assert httpx.get(f"{base}/health_generate", timeout=30).json() == {"status": "ok"}
    assert httpx.get(f"{base}/get_model_info", timeout=30).json()["is_generation"] is True
    assert httpx.get(f"{base}/version", timeout=30).json()["version"]


def test_sglang_response_prefill_needs_only_continue_final_message(client):
    messages = [{"role": "user", "content": "Give JSON."}, {"role": "assistant", "content": "```json\n"}]
    prefilled = client.chat.completions.create(model="demo-vl", messages=messages, max_tokens=3, temperature=0,
                                               extra_body={"continue_final_message": True})
    explicit = client.chat.completions.create(model="demo-vl", messages=messages, max_tokens=3, temperature=0,
                                              extra_body={"continue_final_message": True,
                                                          "add_generation_prompt": False})
    assert prefilled.choices[0].message.content == explicit.choices[0].message.content
    assert prefilled.usage.prompt_tokens == explicit.usage.prompt_tokens


def test_vllm_guided_fields_map_to_constraints(client, base):
    def ask(**extra):
        return client.chat.completions.create(model="demo-vl", messages=USER, max_tokens=12, temperature=0,
                                              extra_body=extra).choices[0].message.content

    assert ask(guided_choice=["red circle", "blue square"]) in ("red circle", "blue square")
    assert ask(structured_outputs={"choice": ["yes", "no"]}) in ("yes", "no")
    assert ask(guided_regex="[0-9]{3}").isdigit()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    reply = client.chat.completions.create(model="demo-vl", messages=USER, max_tokens=20, temperature=0,
                                           extra_body={"guided_json": schema})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content)["n"], int)
    assert_400(chat(base, guided_choice=["a"], guided_regex="b"), "guided_regex")
    assert_400(chat(base, guided_decoding_backend="xgrammar"), "guided_decoding_backend")
    assert_400(chat(base, guided_regex="(", max_tokens=2), "regex")
