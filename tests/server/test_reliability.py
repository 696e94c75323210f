"""Reliability of a real `tessera serve`: a small soak with hostile inputs, the logs a person reads, client
disconnects, SIGTERM with requests in flight, and a scheduler process that dies."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tessera.bench.soak import HOSTILE_KINDS, IDLE_GAUGES, SoakConfig, read_gauges, run_soak
from tests.server.server_process import ServerProcess, children_of


@pytest.fixture(scope="module")
def server(vl_server):
    """The session's demo-vl server (its private-URL permission turns those hostile requests into 422s)."""
    return vl_server


def gauges(server) -> dict[str, float]:
    import asyncio

    async def read():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=30) as c:
            return await read_gauges(c)

    return asyncio.run(read())


def wait_idle(server, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        g = gauges(server)
        if all(g[k] == 0 for k in IDLE_GAUGES) or time.monotonic() > deadline:
            return g
        time.sleep(0.3)


def chat(content, **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, **kw}


def test_small_soak_with_hostile_inputs(server):
    """Every hostile kind at least once among normal requests: all answered, no 5xx, each hostile one a 4xx
    in OpenAI's shape, normal answers equal to their answers alone, /metrics idle after the drain."""
    result = run_soak(SoakConfig(base_url=server.base_url, num_requests=72, concurrency=8, hostile_fraction=0.25,
                                 distinct_prompts=6, max_tokens=8), progress=False)
    assert result.ok, result.failures
    assert set(HOSTILE_KINDS) <= set(result.by_kind)
    assert result.answers_equal_alone == 1.0
    assert all(int(s) < 500 for s in result.statuses)


def test_startup_and_access_log_lines(server):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat("Hello", max_tokens=3),
                   headers={"X-Request-Id": "log-check-1"}, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "log-check-1"
    time.sleep(0.2)
    out = server.output()
    assert out.index("KV pool:") < out.index("listening on"), "'listening' must come after the model is ready"
    assert "parameters, dtype float32, device cpu" in out
    line = next(x for x in out.splitlines() if "request_id=log-check-1" in x)
    for part in ("POST /v1/chat/completions 200", "prompt_tokens=", "cached_tokens=", "output_tokens=3", "ttft=",
                 "latency="):
        assert part in line, line
    assert "Traceback" not in out
    assert "sequence length is longer" not in out  # the soak's huge prompts are refused without the HF warning


@pytest.mark.slow
def test_disconnects_mid_stream_and_mid_prefill_leave_nothing_allocated(server):
    long_prompt = "one two three four five six seven eight " * 380  # ~3000 tokens: two prefill chunks
    for i in range(20):
        body = chat(f"Tell me story {i}.", stream=True, max_tokens=2000, ignore_eos=True)
        with httpx.Client(timeout=60) as c, c.stream("POST", f"{server.base_url}/v1/chat/completions",
                                                     json=body) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n > 3:
                    break
        with pytest.raises(httpx.TimeoutException):  # gone while its prompt is being prefilled
            httpx.post(f"{server.base_url}/v1/chat/completions", timeout=0.15,
                       json=chat(f"{i} {long_prompt}", max_tokens=500, ignore_eos=True))
    g = wait_idle(server)
    assert all(g[k] == 0 for k in IDLE_GAUGES), g


@pytest.mark.slow
def test_sigterm_drains_requests_in_flight_and_exits():
    srv = ServerProcess("--model-path", "demo-vl", "--enable-metrics", "false")
    try:
        assert httpx.get(f"{srv.base_url}/metrics").status_code == 404  # --enable-metrics false
        results: list = [None] * 4

        def stream(i: int) -> None:
            body = chat(f"Count for me {i}.", stream=True, max_tokens=1500, ignore_eos=True)
            lines = []
            try:
                with httpx.Client(timeout=60) as c, c.stream("POST", f"{srv.base_url}/v1/chat/completions",
                                                             json=body) as r:
                    lines = [x for x in r.iter_lines() if x]
                results[i] = (r.status_code, lines)
            except httpx.HTTPError as e:
                results[i] = ("dropped", str(e))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)  # all four are decoding (1500 tokens take several seconds)
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=40)
        code = srv.proc.wait(timeout=40)
        took = time.monotonic() - start
    finally:
        srv.stop()
    assert took < 30, f"exit took {took:.1f} s"
    assert code in (0, -15), srv.output()[-2000:]
    for res in results:
        assert res is not None and res[0] == 200, res
        assert res[1][-1] == "data: [DONE]", res[1][-3:]  # drained: each stream finished
        chunks = [json.loads(x[6:]) for x in res[1][:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "draining 4 in-flight request(s)" in srv.output()


@pytest.mark.slow
def test_a_dead_scheduler_fails_requests_with_503_and_stops_the_server():
    srv = ServerProcess("--model-path", "demo-vl")
    try:
        result: dict = {}

        def long_request() -> None:
            r = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=120,
                           json=chat("Go on.", max_tokens=3000, ignore_eos=True))
            result["status"], result["body"], result["at"] = r.status_code, r.json(), time.monotonic()

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(1.5)
        (scheduler,) = children_of(srv.proc.pid)
        killed = time.monotonic()
        os.kill(scheduler, signal.SIGKILL)
        t.join(timeout=30)
        assert result["status"] == 503 and result["body"]["error"]["code"] == 503, result
        assert result["at"] - killed < 1.5, f"503 after {result['at'] - killed:.2f} s"
        code = srv.proc.wait(timeout=15)
    finally:
        srv.stop()
    assert code == 1
    out = srv.output()
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert errors == ["error: RuntimeError: the scheduler process exited; the server stopped"], out[-2000:]
    assert "Traceback" not in out
