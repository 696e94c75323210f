"""OpenAI's standard request fields, as its SDK and the libraries over it send them: accepted at every value
Tessera can honour, refused (400 naming the field) at the others."""

from __future__ import annotations

import httpx
import pytest

BASE = {"messages": [{"role": "user", "content": "How many shapes are there?"}], "max_tokens": 4, "temperature": 0}
ACCEPTED = {"store": False, "metadata": {"app": "test"}, "service_tier": "auto", "prompt_cache_key": "user-17",
            "safety_identifier": "hashed-user", "user": "u1", "verbosity": "medium", "modalities": ["text"],
            "prediction": None, "audio": None}
REFUSED = {"store": True, "service_tier": "priority", "verbosity": "low", "modalities": ["text", "audio"],
           "prediction": {"type": "content", "content": "three"}, "audio": {"voice": "alloy", "format": "wav"}}


def test_standard_fields_at_honoured_values(vl_server) -> None:
    for path, body in (("/v1/chat/completions", BASE), ("/v1/completions", {"prompt": "Hi", "max_tokens": 2})):
        r = httpx.post(f"{vl_server.base_url}{path}", json={**body, **ACCEPTED}, timeout=60)
        assert r.status_code == 200, r.text
    plain = httpx.post(f"{vl_server.base_url}/v1/chat/completions", json=BASE, timeout=60).json()
    tagged = httpx.post(f"{vl_server.base_url}/v1/chat/completions", json={**BASE, **ACCEPTED}, timeout=60).json()
    assert tagged["choices"][0]["message"] == plain["choices"][0]["message"]  # they change nothing


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_values_that_cannot_be_honoured_are_refused_by_name(vl_server, name) -> None:
    r = httpx.post(f"{vl_server.base_url}/v1/chat/completions", json={**BASE, name: REFUSED[name]}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == name and r.json()["error"]["message"].startswith(f"{name}: ")


def test_the_openai_sdk_sends_them(vl_server) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{vl_server.base_url}/v1", api_key="none")
    out = client.chat.completions.create(model="demo-vl", messages=BASE["messages"], max_tokens=4, store=False,
                                         metadata={"k": "v"}, service_tier="auto", prompt_cache_key="k",
                                         safety_identifier="s", modalities=["text"], verbosity="medium")
    assert out.choices[0].message.content
