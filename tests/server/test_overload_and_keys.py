"""--max-queued-requests: past the running slots plus the queue, a request gets 503 with Retry-After in
OpenAI's error shape, counted in /metrics, while every admitted request finishes in full; the API key read
from TESSERA_API_KEY or --api-key-file (never needed on the command line)."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest

from tessera.entrypoints.middleware import API_KEY_ENV, api_key_of
from tests.server.server_process import ServerProcess

KEY = "env-sekret-42"
RUNNING, QUEUED, SENT, TOKENS = 2, 2, 10, 48


@pytest.fixture(scope="module")
def server():
    old = os.environ.get(API_KEY_ENV)
    os.environ[API_KEY_ENV] = KEY  # the server process inherits it; nothing on its command line
    try:
        srv = ServerProcess("--model-path", "demo-vl", "--max-running-requests", str(RUNNING),
                            "--max-queued-requests", str(QUEUED))
    finally:
        if old is None:
            os.environ.pop(API_KEY_ENV)
        else:
            os.environ[API_KEY_ENV] = old
    yield srv
    srv.stop()


def test_overload_is_a_503_with_retry_after_and_admitted_requests_finish(server):
    auth = {"Authorization": f"Bearer {KEY}"}

    async def burst():
        async with httpx.AsyncClient(base_url=server.base_url, headers=auth, timeout=120) as c:
            body = {"prompt": "Once upon a time", "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(SENT)))

    replies = asyncio.run(burst())
    ok = [r for r in replies if r.status_code == 200]
    refused = [r for r in replies if r.status_code == 503]
    assert len(ok) + len(refused) == SENT, [r.status_code for r in replies]
    assert RUNNING + QUEUED >= len(ok) >= 1 and refused  # never more admitted than the slots and the queue
    assert all(r.json()["usage"]["completion_tokens"] == TOKENS for r in ok)  # admitted: served in full
    assert len({r.json()["choices"][0]["text"] for r in ok}) == 1
    for r in refused:
        assert r.headers["retry-after"].isdigit()
        err = r.json()["error"]
        assert err["code"] == 503 and err["type"] == "service_unavailable" and "max-queued-requests" in err["message"]
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    line = next(ln for ln in metrics.splitlines() if ln.startswith("tessera_rejected_requests_total"))
    assert float(line.split()[-1]) == len(refused)
    # Once the burst is over the server admits again.
    again = httpx.post(f"{server.base_url}/v1/completions", headers=auth, timeout=60,
                       json={"prompt": "Hi", "max_tokens": 2})
    assert again.status_code == 200, again.text


def test_api_key_from_the_environment(server):
    url = f"{server.base_url}/v1/completions"
    body = {"prompt": "Hi", "max_tokens": 1}
    assert httpx.post(url, json=body, timeout=30).status_code == 401
    assert httpx.post(url, json=body, timeout=30, headers={"Authorization": f"Bearer {KEY}x"}).status_code == 401
    assert httpx.post(url, json=body, timeout=30, headers={"Authorization": f"Bearer {KEY[:-1]}"}).status_code == 401
    assert httpx.post(url, json=body, timeout=30, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200  # probes need no key
    info = httpx.get(f"{server.base_url}/get_server_info", timeout=30, headers={"Authorization": f"Bearer {KEY}"})
    assert KEY not in info.text


def test_api_key_sources(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert api_key_of(None, None) is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert api_key_of(None, None) == "from-env"
    assert api_key_of("from-flag", None) == "from-flag"
    f = tmp_path / "key"
    f.write_text("from-file\n")
    assert api_key_of(None, str(f)) == "from-file"  # the file wins over the environment, its newline dropped
    with pytest.raises(ValueError, match="api_key_file: give either"):
        api_key_of("from-flag", str(f))
    f.write_text("  \n")
    with pytest.raises(ValueError, match="api_key_file: .* is empty"):
        api_key_of(None, str(f))
    with pytest.raises(ValueError, match="api_key_file: cannot read"):
        api_key_of(None, str(tmp_path / "missing"))


def test_prepared_requests_count_against_the_queue_until_their_generation_starts(monkeypatch):
    """A streamed response starts some event-loop turns after its endpoint returned: the generations prepared
    but not started yet count too (with 192 clients, 56 got in under a cap of 48 before they did). One whose
    response never starts (its client left first) stops counting after PREPARED_TTL_S."""
    from types import SimpleNamespace

    from tessera.entrypoints.openai import serving as serving_mod
    from tessera.entrypoints.openai.errors import APIError
    from tessera.frontend.request import GenerateRequest

    class StubTM:
        args = SimpleNamespace(max_queued_requests=1, max_running_requests=1, dp_size=1)
        info = SimpleNamespace(hf_processor=None, tokenizer=SimpleNamespace(chat_template=None))

        def __init__(self):
            self.states = {}

        async def tokenize(self, r):
            return SimpleNamespace(input_ids=[1, 2])

        async def generate(self, r, t):
            self.states[r.rid] = r
            try:
                await asyncio.sleep(0)
                yield {"text": "x"}
            finally:
                del self.states[r.rid]

    async def scenario():
        s = serving_mod.OpenAIServing(StubTM(), "stub")
        first = [GenerateRequest(text="a"), GenerateRequest(text="b")]  # one running slot + one queued
        tokenized = await s.prepare(first, {})
        with pytest.raises(APIError) as refused:
            await s.prepare([GenerateRequest(text="c")], {})
        assert refused.value.status == 503
        assert sorted([i async for i, _ in s.merged_stream(first, tokenized)]) == [0, 1]
        assert not s.prepared and not s.tm.states
        d, e, f = GenerateRequest(text="d"), GenerateRequest(text="e"), GenerateRequest(text="f")
        await s.prepare([d, e], {})  # both finished: room again
        with pytest.raises(APIError):
            await s.prepare([f], {})
        monkeypatch.setattr(serving_mod, "PREPARED_TTL_S", 0.0)
        await s.prepare([f], {})  # d and e never started: they no longer count
        assert list(s.prepared) == [f.rid]

    asyncio.run(scenario())


def test_bench_overload_run_passes_its_checks(server):
    """`tessera bench overload` on this server (2 running + 2 queued): a few seconds at 4x capacity."""
    from tessera.bench.overload import OverloadConfig, format_result, run_overload

    result = run_overload(OverloadConfig(base_url=server.base_url, max_running=RUNNING, max_queued=QUEUED,
                                         duration_s=4, baseline_s=0, max_tokens=4, api_key=KEY))
    phase, = result["phases"]
    assert result["ok"], format_result(result)
    assert phase["clients"] == 16 and phase["rejected_503"] > 0 and phase["completed"] == phase["admitted"] > 0
    assert phase["max_frontend_reqs"] <= RUNNING + QUEUED and phase["latency_s"]["p99"] >= phase["latency_s"]["p50"]
