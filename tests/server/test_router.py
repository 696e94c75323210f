"""Two `tessera serve` workers behind a real sglang-router (cache-aware): what the router asks of a worker
(/server_info's model name, /get_load), SGLang's /generate with the router's `"model": null`, a chat without
`model` (the router fills in "unknown"), streaming, prefix groups kept on one worker, and a worker killed
under load with no request lost (the router retries on the other)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.server_process import ServerProcess, free_port

pytest.importorskip("sglang_router")

CHAT = {"messages": [{"role": "user", "content": "How many shapes are there?"}], "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def fleet(vl_server):
    """The session's demo-vl server and a second worker (the one killed at the end) behind one router."""
    worker = ServerProcess("--model-path", "demo-vl", "--max-total-tokens", "8192")
    port = free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
         "--policy", "cache_aware", "--log-level", "warn", "--health-check-interval-secs", "1",
         # Retries that outlast a health-check interval: a request retried only within the router's default
         # backoff can land on the killed worker each time before it is taken out (seen once on a loaded machine).
         "--retry-max-retries", "8", "--retry-max-backoff-ms", "2000",
         "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
         "--worker-urls", vl_server.base_url, worker.base_url],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:  # ready once it has registered both workers under the served model's name
            try:
                models = httpx.get(f"{url}/v1/models", timeout=5).json()["data"]
                if [m["id"] for m in models] == ["demo-vl"] and httpx.post(
                        f"{url}/v1/chat/completions", json=CHAT, timeout=30).status_code == 200:
                    break
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            assert time.monotonic() < deadline and router.poll() is None, "the router did not come up"
            time.sleep(0.5)
        yield url, vl_server, worker
    finally:
        router.terminate()
        router.wait(timeout=30)
        worker.stop()


def test_worker_reports_what_the_router_reads(vl_server):
    info = httpx.get(f"{vl_server.base_url}/server_info", timeout=30).json()
    assert info["served_model_name"] == "demo-vl"
    assert info["max_total_tokens"] == 16384 and info["max_running_requests"] > 0 and info["dp_size"] == 1
    assert httpx.get(f"{vl_server.base_url}/get_server_info", timeout=30).json()["served_model_name"] == "demo-vl"
    (load,) = httpx.get(f"{vl_server.base_url}/get_load", timeout=30).json()
    assert set(load) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"} and load["dp_rank"] == 0


@pytest.mark.parametrize("model", [None, "unknown", "demo-vl"])
def test_model_placeholders_are_the_served_model(vl_server, model):
    r = httpx.post(f"{vl_server.base_url}/v1/chat/completions", json={**CHAT, "model": model}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{vl_server.base_url}/generate", json={"text": "Hi", "model": model,
                                                           "sampling_params": {"max_new_tokens": 2}}, timeout=60)
    assert r.status_code == 200, r.text
    r = httpx.post(f"{vl_server.base_url}/generate", json={"text": "Hi", "model": "gpt-9"}, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_through_the_router(fleet):
    url, _, _ = fleet
    r = httpx.post(f"{url}/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["completion_tokens"] == 4
    plain = httpx.post(f"{url}/v1/chat/completions", json=CHAT, timeout=60)
    assert plain.status_code == 200, plain.text
    assert plain.json()["model"] == "demo-vl"
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**CHAT, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    text = "".join(json.loads(x)["choices"][0]["delta"].get("content") or "" for x in lines[:-1])
    assert text == plain.json()["choices"][0]["message"]["content"]


def test_cache_aware_routing_keeps_a_prefix_on_one_worker(fleet):
    url, _, _ = fleet
    prefix = "You are a careful assistant who counts shapes. " * 12
    cached = []
    for question in ("How many shapes?", "Which colour?", "Where is the circle?", "Name them."):
        body = {"messages": [{"role": "system", "content": prefix}, {"role": "user", "content": question}],
                "max_tokens": 2}
        usage = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["usage"]
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    assert all(c >= 100 for c in cached[1:]), cached  # each follow-up found the shared prefix cached


def test_a_killed_worker_loses_no_request(fleet):
    url, _, worker = fleet

    def one(i: int) -> int:
        body = {**CHAT, "messages": [{"role": "user", "content": f"Question {i}: how many shapes are there?"}]}
        return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).status_code

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(one, i) for i in range(48)]
        time.sleep(1.0)
        worker.proc.kill()  # SIGKILL: its requests in flight break mid-answer
        codes = [f.result() for f in futures]
    assert codes == [200] * len(codes), codes
