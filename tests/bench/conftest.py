"""A tiny in-process fake OpenAI chat server: streams fixed-timing chunks and records what it received."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
# Module level: FastAPI resolves the string annotations (from __future__) against module globals.
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

FAKE_MODEL = "fake-model"
TTFT_S = 0.05  # server-side delay before the first token
ITL_S = 0.01  # delay between tokens


@dataclass
class FakeState:
    bodies: list[dict] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0


@dataclass
class FakeServer:
    base_url: str
    state: FakeState


def _app(state: FakeState):
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": FAKE_MODEL, "object": "model", "created": 0, "owned_by": "x"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        state.bodies.append(body)
        text = body["messages"][-1]["content"][-1]["text"]
        if "FAIL" in text:
            return JSONResponse({"error": {"message": "messages: refused by the fake", "type": "invalid_request_error",
                                           "param": None, "code": None}}, status_code=400)
        n = body["max_tokens"]

        def chunk(delta: dict, finish: str | None = None, usage: dict | None = None) -> str:
            obj = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": FAKE_MODEL,
                   "choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]}
            if usage:
                obj["usage"] = usage
            return f"data: {json.dumps(obj)}\n\n"

        async def stream():
            state.in_flight += 1
            state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                yield chunk({"role": "assistant", "content": ""})
                await asyncio.sleep(TTFT_S)
                for i in range(n):
                    if i:
                        await asyncio.sleep(ITL_S)
                    yield chunk({"content": "x"}, "length" if i == n - 1 else None)
                yield chunk({}, usage={"prompt_tokens": 7, "completion_tokens": n, "total_tokens": 7 + n})
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture(scope="session")
def fake_server_base() -> Iterator[tuple[str, FakeState]]:
    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = FakeState()
    server = uvicorn.Server(uvicorn.Config(_app(state), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("fake OpenAI server did not start")
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(timeout=5)


@pytest.fixture()
def fake_server(fake_server_base) -> FakeServer:
    """The shared fake server, with its records cleared for this test."""
    url, state = fake_server_base
    state.bodies.clear()
    state.in_flight = state.max_in_flight = 0
    return FakeServer(url, state)
