"""Tool-call formats of every family served, `--tool-call-parser` / the template's choice, `--reasoning-parser`,
bounded numbers in forced calls, and demo-vl's tool-capable template (issue 63). The API tests run the real app
over a scheduler stand-in that answers with a scripted reply, piece by piece (stub_app.py)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tessera.entrypoints.openai.reasoning import ReasoningSplitter, split_reasoning
from tessera.entrypoints.openai.tool_calls import bounded_numbers
from tessera.entrypoints.openai.tool_parsers import FORMATS, ToolCallParser, format_of_template
from tests.conftest import TOOL_TEMPLATE
from tests.server.stub_app import stub_client

TOOLS = [{"type": "function", "function": {"name": "count", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}, "x": {"type": "number"}}, "required": ["n", "x"]}}}]
USER = [{"role": "user", "content": "Count."}]
# parser -> (reply, content, [(name, arguments)])
CASES = {
    "hermes": ('Sure.<tool_call>\n{"name": "count", "arguments": {"n": 3}}\n</tool_call>', "Sure.",
               [("count", {"n": 3})]),
    "llama3": ('<|python_tag|>{"name": "count", "parameters": {"n": 3}}; {"name": "count", "parameters": {"n": 4}}',
               "", [("count", {"n": 3}), ("count", {"n": 4})]),
    "llama4": ('[count(n=3, x=1.5), count(n=4, x=0)]', "", [("count", {"n": 3, "x": 1.5}), ("count", {"n": 4, "x": 0})]),
    "pythonic": ('<|python_start|>[count(n=3)]<|python_end|>', "", [("count", {"n": 3})]),
    "mistral": ('[TOOL_CALLS]count[ARGS]{"n": 3}', "", [("count", {"n": 3})]),
    "gemma": ('Counting.\n```tool_code\ncount(n=3)\n```', "Counting.\n", [("count", {"n": 3})]),
    "internlm": ('ok<|action_start|><|plugin|>\n{"name": "count", "parameters": {"n": 3}}<|action_end|>', "ok",
                 [("count", {"n": 3})]),
    "glm45": ('<tool_call>count\n<arg_key>n</arg_key>\n<arg_value>3</arg_value>\n</tool_call>', "",
              [("count", {"n": 3})]),
}


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("parser", sorted(CASES))
def test_each_format_whole_and_one_character_at_a_time(parser):
    reply, content, calls = CASES[parser]
    p, streamed, got = ToolCallParser(FORMATS[parser]), "", []
    for ch in reply:  # no marker leaks into content, whatever the split
        text, done = p.feed(ch)
        streamed, got = streamed + text, got + done
    tail, more = p.finish()
    assert streamed + tail == content and _calls(got + more) == calls
    plain = ToolCallParser(FORMATS[parser])
    text, done = plain.feed("Just text, [no] {call} here.")
    tail, more = plain.finish()
    assert text + tail == "Just text, [no] {call} here." and not done + more


def test_the_format_is_read_from_the_template():
    assert format_of_template(TOOL_TEMPLATE.read_text()).name == "hermes"
    assert format_of_template("{{ tools }}[TOOL_CALLS]").name == "mistral"
    assert format_of_template("{{ tools }}<tool_call>{{ name }}<arg_key>").name == "glm45"
    assert format_of_template("{{ tools }}<|python_start|>").name == "llama4"
    assert format_of_template("{% for m in messages %}{{ m.content }}{% endfor %}") is None


def test_demo_vl_ships_the_tool_template_and_renders_plain_chats_as_before():
    from tessera.demo.build_vl import CHAT_TEMPLATE, CHAT_TEMPLATE_WITH_TOOLS

    shipped = (Path(__file__).parents[2] / "tessera" / "assets" / "demo-vl" / "chat_template.jinja").read_text()
    assert shipped == CHAT_TEMPLATE_WITH_TOOLS == TOOL_TEMPLATE.read_text()
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    chats = [USER, [{"role": "system", "content": "S"}, *USER],
             [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]},
              {"role": "assistant", "content": "three"}, {"role": "user", "content": [{"type": "video"}]}]]
    for messages in chats:
        for gen in (True, False):
            assert env.from_string(shipped).render(messages=messages, add_generation_prompt=gen) == \
                env.from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=gen)


def test_bounded_numbers_keep_given_bounds_and_bound_the_rest():
    out = bounded_numbers(TOOLS[0]["function"]["parameters"])
    n, x = out["properties"]["n"], out["properties"]["x"]
    assert n["maximum"] == 10**15 - 1 and n["minimum"] == -(10**15 - 1) and "multipleOf" not in n
    assert x["multipleOf"] == 1e-6
    kept = bounded_numbers({"type": ["integer", "null"], "minimum": 0})
    assert kept["minimum"] == 0 and kept["maximum"] == 10**15 - 1


def test_forced_call_numbers_are_bounded_by_the_grammar():
    """The digits a forced call's grammar allows end: 15 for an integer, 6 decimals (was: without end)."""
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    from tessera.constrained.grammar import grammar_text
    from tessera.entrypoints.openai.tool_calls import ToolPlan

    schema = ToolPlan(TOOLS, "required").call_schema()
    tok = AutoTokenizer.from_pretrained(Path(__file__).parents[2] / "tessera" / "assets" / "demo-vl")
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok), grammar_text("json_schema", schema))
    prefix = '{"name":"count","arguments":{"n":'
    for digits, ok in (("5" * 15, True), ("5" * 16, False)):
        ids = tok.encode(prefix + digits, add_special_tokens=False)
        assert (matcher.validate_tokens(ids) == len(ids)) == ok
    ids = tok.encode(prefix + '1,"x":0.' + "5" * 7, add_special_tokens=False)
    assert matcher.validate_tokens(ids) < len(ids)


def _stream(client, body) -> list[dict]:
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x)["choices"][0]["delta"] for x in lines[:-1] if json.loads(x)["choices"]]


@pytest.mark.parametrize("parser", ["llama4", "mistral", "glm45"])
def test_tool_call_parser_flag_through_the_api(parser):
    reply, content, calls = CASES[parser]
    pieces = [reply[i:i + 3] for i in range(0, len(reply), 3)]
    with stub_client(pieces, tool_call_parser=parser) as client:
        body = {"messages": USER, "tools": TOOLS}
        msg = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert msg["finish_reason"] == "tool_calls" and _calls(msg["message"]["tool_calls"]) == calls
        deltas = _stream(client, body)
        args: dict[int, str] = {}
        for d in deltas:
            for tc in d.get("tool_calls") or []:
                args[tc["index"]] = args.get(tc["index"], "") + tc["function"].get("arguments", "")
        assert [json.loads(a) for _, a in sorted(args.items())] == [a for _, a in calls]
        assert "".join(d.get("content") or "" for d in deltas) == content


REASONED = ["<th", "ink>", "Three ", "shapes", "...</th", "ink>\n\n", "There are ", "three."]


def test_reasoning_parser_streamed_and_whole():
    with stub_client(REASONED, reasoning_parser="qwen3") as client:
        msg = client.post("/v1/chat/completions", json={"messages": USER}).json()["choices"][0]["message"]
        assert msg["reasoning_content"] == msg["reasoning"] == "Three shapes..."
        assert msg["content"] == "There are three."
        deltas = _stream(client, {"messages": USER})
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Three shapes..."
        assert "".join(d.get("content") or "" for d in deltas) == "There are three."
        assert all("<think>" not in (d.get("content") or "") for d in deltas)
        off = client.post("/v1/chat/completions", json={"messages": USER, "chat_template_kwargs": {
            "enable_thinking": False}}).json()["choices"][0]["message"]
        assert off["content"] == "".join(REASONED) and "reasoning_content" not in off


def test_reasoning_splitter_forced_and_unknown_parser():
    assert split_reasoning(ReasoningSplitter.of("deepseek-r1"), "thinking</think>answer") == ("thinking", "answer")
    assert split_reasoning(ReasoningSplitter.of("qwen3"), "no thinking here") == (None, "no thinking here")
    with pytest.raises(ValueError, match="reasoning_parser"):
        from tessera.entrypoints.openai.reasoning import check_reasoning_parser

        check_reasoning_parser("nope")


def test_truncated_call_sent_back_is_accepted_and_forced_calls_of_the_demo_model(vl_server):
    url = f"{vl_server.base_url}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "Count the shapes."}], "tools": TOOLS, "max_tokens": 12,
            "tool_choice": {"type": "function", "function": {"name": "count"}}, "temperature": 1.0, "seed": 3}
    r = httpx.post(url, json=body, timeout=60).json()["choices"][0]
    call = r["message"]["tool_calls"][0]
    assert call["function"]["name"] == "count"
    if r["finish_reason"] == "stop":
        args = json.loads(call["function"]["arguments"])
        assert abs(args["n"]) < 10**15
    history = body["messages"] + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "count", "arguments": '{"n": 55555'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    follow = httpx.post(url, json={"messages": history, "tools": TOOLS, "max_tokens": 4}, timeout=60)
    assert follow.status_code == 200, follow.text
