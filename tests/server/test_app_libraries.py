"""Application libraries against the default demo model (its own template renders tools): each completes an
image + tool round trip (the image sent, a call constrained to the tool's schema, the tool run, its result sent
back, a final answer). openai-agents in both its chat-completions and Responses modes, pydantic-ai (a function
tool and its structured output tool), LangChain's bind_tools (whole and streamed), and instructor's tools and
JSON-schema modes (a pydantic response model filled from the image). instructor is installed without its
dependencies (the Makefile's PEER_CLIENT): its metadata asks for jiter < 0.15, which the pinned openai outgrew, but
it runs on the pinned jiter and openai."""

from __future__ import annotations

import asyncio
import base64
from typing import Literal

import pytest

from tests.conftest import EXAMPLE_IMAGE

IMAGE = "data:image/png;base64," + base64.b64encode(EXAMPLE_IMAGE.read_bytes()).decode()
QUESTION = "How many shapes are there?"
Colour = Literal["red", "green", "blue"]


@pytest.mark.parametrize("mode", ["chat", "responses"])
def test_openai_agents_tool_loop_with_an_image(vl_server, mode):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # no trace export to OpenAI's servers
    calls = []

    @agents.function_tool
    def count_shapes(colour: Colour) -> str:
        """Count the shapes of one colour in the picture."""
        calls.append(colour)
        return "3"

    client = AsyncOpenAI(base_url=f"{vl_server.base_url}/v1", api_key="none", max_retries=0)
    model = (agents.OpenAIChatCompletionsModel if mode == "chat" else agents.OpenAIResponsesModel)("demo-vl", client)
    agent = agents.Agent(name="counter", instructions="Count shapes.", tools=[count_shapes], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=64, temperature=0))
    image_turn = [{"role": "user", "content": [{"type": "input_image", "image_url": IMAGE, "detail": "auto"},
                                               {"type": "input_text", "text": QUESTION}]}]
    result = asyncio.run(agents.Runner.run(agent, image_turn, max_turns=4))
    assert calls and calls[0] in ("red", "green", "blue")  # the forced call ran the tool ...
    assert isinstance(result.final_output, str) and result.final_output  # ... and its result got an answer


def test_pydantic_ai_function_tool_and_structured_output(vl_server):
    pytest.importorskip("pydantic_ai")
    from pydantic import BaseModel
    from pydantic_ai import Agent, BinaryContent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class Answer(BaseModel):
        shapes: Literal[1, 2, 3, 4]

    model = OpenAIChatModel("demo-vl", provider=OpenAIProvider(base_url=f"{vl_server.base_url}/v1", api_key="none"))
    agent = Agent(model, instructions="Count shapes.", output_type=Answer,
                  model_settings={"max_tokens": 48, "temperature": 0})
    calls = []

    @agent.tool_plain
    def count_shapes(colour: Colour) -> str:
        """Count the shapes of one colour in the picture."""
        calls.append(colour)
        return "3"

    result = agent.run_sync([QUESTION, BinaryContent(EXAMPLE_IMAGE.read_bytes(), media_type="image/png")])
    assert isinstance(result.output, Answer)  # its output tool's call, validated by pydantic-ai
    assert len(result.all_messages()) >= 2


def test_langchain_bind_tools_round_trip_whole_and_streamed(vl_server):
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def count_shapes(colour: Colour) -> str:
        """Count the shapes of one colour in the picture."""
        return "3"

    llm = ChatOpenAI(model="demo-vl", base_url=f"{vl_server.base_url}/v1", api_key="none", max_tokens=48,
                     temperature=0, max_retries=0)
    messages = [HumanMessage(content=[{"type": "image_url", "image_url": {"url": IMAGE}},
                                      {"type": "text", "text": QUESTION}])]
    forced = llm.bind_tools([count_shapes], tool_choice="count_shapes")
    ai = forced.invoke(messages)
    (call,) = ai.tool_calls
    assert call["name"] == "count_shapes" and call["args"]["colour"] in ("red", "green", "blue")
    streamed = None
    for chunk in forced.stream(messages):
        streamed = chunk if streamed is None else streamed + chunk
    assert [c["args"] for c in streamed.tool_calls] == [call["args"]]  # temperature 0: the same call
    messages += [ai, ToolMessage(content=count_shapes.invoke(call["args"]), tool_call_id=call["id"])]
    final = llm.bind_tools([count_shapes]).invoke(messages)
    assert final.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_response_model_from_an_image(vl_server, mode):
    instructor = pytest.importorskip("instructor", reason="installed by `make test` (the Makefile's PEER_CLIENT)")
    from openai import OpenAI
    from pydantic import BaseModel

    class Count(BaseModel):
        colour: Colour
        shapes: Literal[1, 2, 3, 4]

    openai = OpenAI(base_url=f"{vl_server.base_url}/v1", api_key="none", max_retries=0)
    client = instructor.from_openai(openai, mode=getattr(instructor.Mode, mode))
    question = {"type": "text", "text": QUESTION}
    count, completion = client.chat.completions.create_with_completion(
        model="demo-vl", response_model=Count, max_retries=0, max_tokens=48, temperature=0,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": IMAGE}}, question]}])
    assert isinstance(count, Count)  # validated by instructor against the pydantic model
    sent = completion.choices[0].message  # tools mode reads a tool call, JSON-schema mode the content
    assert (sent.tool_calls[0].function.name == "Count") if mode == "TOOLS" else sent.content
    text_only = openai.chat.completions.create(model="demo-vl", max_tokens=1,
                                               messages=[{"role": "user", "content": [question]}])
    assert completion.usage.prompt_tokens > text_only.usage.prompt_tokens + 16  # instructor sent the image on
