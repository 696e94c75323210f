"""The server middleware without a model: request ids, the API key, the access-log line, and unexpected
errors turned into a 500 that names the request id but never a traceback or a server path."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from tessera.entrypoints.middleware import ServerMiddleware, observe_generation
from tessera.entrypoints.openai.errors import public_message
from tessera.frontend.result import GenerateResult
from tessera.frontend.tokenizer_manager import EngineUnavailable

HERE = __file__


def make_app(api_key: str | None = None, max_body_bytes: int | None = None) -> tuple[FastAPI, list]:
    app = FastAPI()
    counted: list = []
    app.add_middleware(ServerMiddleware, api_key=api_key, count=lambda path, status: counted.append((path, status)),
                       max_body_bytes=max_body_bytes)

    @app.post("/v1/echo")
    async def echo(request: Request):
        return {"size": len(await request.body())}

    @app.get("/v1/boom")
    async def boom():
        raise RuntimeError(f"exploded in {HERE}")

    @app.get("/v1/gone")
    async def gone():
        raise EngineUnavailable("the scheduler process exited (code -9)")

    @app.post("/v1/chat/completions")
    async def chat():
        for completion, ttft in ((3, 0.05), (5, 0.04)):
            observe_generation(GenerateResult("r", "", "", [], None, prompt_tokens=12, completion_tokens=completion,
                                              cached_tokens=4, e2e_latency=0.1, ttft=ttft))
        return {"ok": True}

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app, counted


def test_unexpected_error_is_a_500_with_a_request_id_and_no_internals(caplog):
    app, counted = make_app()
    with caplog.at_level(logging.INFO, logger="tessera.access"), TestClient(app, raise_server_exceptions=False) as c:
        r = c.get("/v1/boom", headers={"X-Request-Id": "abc-123"})
    assert r.status_code == 500 and r.headers["x-request-id"] == "abc-123"
    err = r.json()["error"]
    assert err["code"] == 500 and "abc-123" in err["message"]
    assert "Traceback" not in r.text and "exploded" not in r.text and HERE not in r.text
    # The traceback is in the server log, under the same request id.
    assert any("abc-123" in rec.getMessage() and rec.exc_info for rec in caplog.records)
    assert counted == [("/v1/boom", 500)]


def test_engine_unavailable_is_a_503_with_its_message():
    app, _ = make_app()
    with TestClient(app, raise_server_exceptions=False) as c:
        r = c.get("/v1/gone")
    assert r.status_code == 503
    assert r.json()["error"]["message"] == "the scheduler process exited (code -9)"


def test_access_log_line_and_request_ids(caplog):
    app, _ = make_app()
    with caplog.at_level(logging.INFO, logger="tessera.access"), TestClient(app) as c:
        r1 = c.post("/v1/chat/completions", json={})
        r2 = c.post("/v1/chat/completions", json={}, headers={"X-Request-Id": "bad id with spaces"})
        c.get("/health")
    assert r1.headers["x-request-id"] != r2.headers["x-request-id"]
    assert r2.headers["x-request-id"] != "bad id with spaces"  # only safe client ids are echoed
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "tessera.access"]
    assert len(lines) == 2, lines  # /health is logged at debug level only
    line = lines[0]
    for part in ("POST /v1/chat/completions 200", "prompt_tokens=12", "cached_tokens=4", "output_tokens=8",
                 "ttft=40ms", "latency=", f"request_id={r1.headers['x-request-id']}"):
        assert part in line, line


def test_api_key_guards_all_but_health_and_metrics():
    app, _ = make_app(api_key="sekret")
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/chat/completions", json={})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert "missing API key" in r.json()["error"]["message"]  # none sent: say how to send one
        wrong = c.post("/v1/chat/completions", json={}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["message"] == "invalid API key"
        ok = c.post("/v1/chat/completions", json={}, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200


def test_public_message_cuts_tracebacks_and_server_paths():
    import tessera

    root = tessera.__file__.rsplit("/tessera/", 1)[0]
    msg = public_message(f"bad thing in {root}/tessera/x.py\nTraceback (most recent call last):\n  File ...")
    assert "Traceback" not in msg and root not in msg and msg.startswith("bad thing in <server>")


def test_bodies_over_the_limit_are_413_before_they_are_buffered():
    app, _ = make_app(max_body_bytes=100)
    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.post("/v1/echo", content=b"x" * 100).json() == {"size": 100}
        r = c.post("/v1/echo", content=b"x" * 101)
        assert r.status_code == 413 and "--max-request-body-mb" in r.json()["error"]["message"]
        chunked = c.post("/v1/echo", content=iter([b"x" * 60, b"x" * 60]))  # no Content-Length
        assert chunked.status_code == 413 and chunked.json()["error"]["code"] == 413
