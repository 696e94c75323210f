"""Reliability of a real `tessera serve`: a small soak with hostile inputs, the logs a person reads, client
disconnects, SIGTERM with requests in flight, and a scheduler process that dies."""

from __future__ import annotations

import base64
import json
import os
import signal
import threading
import time

import httpx
import pytest

from tessera.bench.soak import HOSTILE_KINDS, IDLE_GAUGES, SoakConfig, read_gauges, run_soak
from tests.conftest import EXAMPLE_IMAGE
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
    assert r.json()["id"] == "chatcmpl-log-check-1"  # the response names the request the log line names
    time.sleep(0.2)
    out = server.output()
    assert out.index("KV pool:") < out.index("listening on"), "'listening' must come after the model is ready"
    assert out.index("warm-up requests done") < out.index("listening on") and out.count("listening") == 1
    # Only our "listening" line: not uvicorn's (before the warm-up), nor the warm-up's own request lines.
    assert "Uvicorn running" not in out and "CTRL+C" not in out and "HTTP Request:" not in out
    assert "request_id=warmup-" not in out
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


def wait_running(base_url: str, n: int, headers: dict | None = None, timeout: float = 60.0) -> None:
    """Polls until `n` requests are running in the scheduler (quicker and surer than a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while httpx.get(f"{base_url}/get_server_info", headers=headers, timeout=30).json()["stats"]["num_running"] < n:
        assert time.monotonic() < deadline, f"fewer than {n} requests running after {timeout:.0f} s"
        time.sleep(0.05)


def gone_or_zombie(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


# Not slow: test-fast ran the --language-model-only / --api-key half before the two were merged.
def test_language_model_only_api_key_and_sigterm_that_drains_requests_in_flight():
    """One server for the flags a test of the shutdown can share (one start instead of two): --language-model-only
    and --api-key are served as documented, then SIGTERM with four streams decoding drains them, exits within
    30 s, and takes the scheduler process down too."""
    srv = ServerProcess("--model-path", "demo-vl", "--language-model-only", "--api-key", "sekret",
                        "--enable-metrics", "false")
    auth = {"Authorization": "Bearer sekret"}
    try:
        assert httpx.get(f"{srv.base_url}/metrics").status_code == 404  # --enable-metrics false
        assert httpx.get(f"{srv.base_url}/model_info").status_code == 401
        info = httpx.get(f"{srv.base_url}/model_info", headers=auth).json()
        assert info["has_image_understanding"] is False and info["has_video_understanding"] is False
        uri = "data:image/png;base64," + base64.b64encode(EXAMPLE_IMAGE.read_bytes()).decode()
        body = chat([{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": "hi"}])
        r = httpx.post(f"{srv.base_url}/v1/chat/completions", json=body, headers=auth, timeout=60)
        assert r.status_code == 400 and "language-model-only" in r.json()["error"]["message"]
        ok = httpx.post(f"{srv.base_url}/v1/chat/completions", headers=auth, timeout=60, json=chat("hi", max_tokens=3))
        assert ok.status_code == 200
        kids = children_of(srv.proc.pid)
        assert kids, "the scheduler runs in a child process"

        results: list = [None] * 4

        def stream(i: int) -> None:
            # 400 tokens: several seconds of decoding at four at a time, far more than the signal needs to land.
            body = chat(f"Count for me {i}.", stream=True, max_tokens=400, ignore_eos=True)
            lines = []
            try:
                with httpx.Client(timeout=60, headers=auth) as c, c.stream(
                        "POST", f"{srv.base_url}/v1/chat/completions", json=body) as r:
                    lines = [x for x in r.iter_lines() if x]
                results[i] = (r.status_code, lines)
            except httpx.HTTPError as e:
                results[i] = ("dropped", str(e))

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        wait_running(srv.base_url, 4, headers=auth)  # all four are decoding
        start = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=40)
        code = srv.proc.wait(timeout=40)
        took = time.monotonic() - start
    finally:
        srv.stop()
    assert took < 30, f"exit took {took:.1f} s"
    assert code == 0, srv.output()[-2000:]  # a clean drain is a clean exit (make shows no error)
    for res in results:
        assert res is not None and res[0] == 200, res
        assert res[1][-1] == "data: [DONE]", res[1][-3:]  # drained: each stream finished
        chunks = [json.loads(x[6:]) for x in res[1][:-1]]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    out = srv.output()
    assert "draining 4 in-flight request(s)" in out and "server stopped" in out
    for pid in kids:  # SIGTERM took the scheduler down too
        assert gone_or_zombie(pid), f"scheduler process {pid} still running"


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
        wait_running(srv.base_url, 1)
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


@pytest.mark.slow
def test_a_second_interrupt_ends_requests_in_flight_cleanly_and_exits_0():
    """Ctrl-C twice (uvicorn invites it: "CTRL+C to force quit"): the first drains, the second ends what is still
    running at once, each in OpenAI's error shape (a 503 JSON body; a final error event and [DONE] for a stream),
    with one log line per request and no traceback; the server exits 0."""
    srv = ServerProcess("--model-path", "demo-vl")
    results: dict = {}

    def plain() -> None:
        r = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=120,
                       json=chat("Go on.", max_tokens=3500, ignore_eos=True))
        results["plain"] = (r.status_code, r.headers.get("content-type", ""), r.json())

    def stream() -> None:
        body = chat("Go on and on.", stream=True, max_tokens=3500, ignore_eos=True)
        with httpx.Client(timeout=120) as c, c.stream("POST", f"{srv.base_url}/v1/chat/completions", json=body) as r:
            results["stream"] = (r.status_code, [x for x in r.iter_lines() if x])

    try:
        threads = [threading.Thread(target=plain), threading.Thread(target=stream)]
        for t in threads:
            t.start()
        wait_running(srv.base_url, 2)
        srv.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)  # draining: both still decoding
        assert srv.proc.poll() is None
        srv.proc.send_signal(signal.SIGINT)
        for t in threads:
            t.join(timeout=30)
        code = srv.proc.wait(timeout=30)
    finally:
        srv.stop()
    out = srv.output()
    assert code == 0, out[-3000:]
    status, ctype, body = results["plain"]
    assert status == 503 and ctype.startswith("application/json"), results["plain"]
    assert body["error"]["code"] == 503 and "shutting down" in body["error"]["message"]
    status, lines = results["stream"]
    assert status == 200 and lines[-1] == "data: [DONE]", lines[-3:]
    error = json.loads(lines[-2][6:])
    assert "shutting down" in error["error"]["message"], lines[-2]
    assert out.count("ended: the server is shutting down") == 2, out[-3000:]
    assert "Traceback" not in out and "Internal Server Error" not in out
