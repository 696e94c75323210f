"""Every request field SGLang and vLLM declare (pinned in tests/fixtures/peer_request_fields.json from their
request models) is honoured, accepted at its no-op value, or refused on purpose with the reason in docs/api.md;
sent at the peer's own default value, each is answered as the peer would (a 200), except the few whose default
means something Tessera does not do (listed here, each a 400 naming the field)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tessera.entrypoints.openai import request_models as rm
from tessera.entrypoints.openai.peer_fields import GENERATE_NOOPS, OPENAI_NOOPS

FIXTURE = json.loads((Path(__file__).parents[1] / "fixtures" / "peer_request_fields.json").read_text())
API_DOC = (Path(__file__).parents[2] / "docs" / "api.md").read_text()
# (peer, model) -> (our endpoint, the fields it honours, its no-op table)
ENDPOINTS = {
    ("sglang", "ChatCompletionRequest"): ("/v1/chat/completions", rm.CHAT_FIELDS, OPENAI_NOOPS),
    ("vllm", "ChatCompletionRequest"): ("/v1/chat/completions", rm.CHAT_FIELDS, OPENAI_NOOPS),
    ("sglang", "CompletionRequest"): ("/v1/completions", rm.COMPLETION_FIELDS, OPENAI_NOOPS),
    ("vllm", "CompletionRequest"): ("/v1/completions", rm.COMPLETION_FIELDS, OPENAI_NOOPS),
    ("sglang", "GenerateReqInput"): ("/generate", rm.GENERATE_FIELDS, GENERATE_NOOPS),
}
# Peer defaults that mean what Tessera does not do: (peer, model, field) -> what the 400 names.
REFUSED_AT_PEER_DEFAULT = {
    ("vllm", "CompletionRequest", "add_special_tokens"): "special tokens",  # True: a BOS would be added
}
BASE = {"/v1/chat/completions": {"model": "demo-vl", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        "/v1/completions": {"model": "demo-vl", "prompt": "hi", "max_tokens": 1},
        "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 1}}}
SET_BY_BASE = {"messages", "prompt", "text", "model", "max_tokens", "sampling_params"}


def _cases():
    for (peer, model), (path, accepted, noops) in ENDPOINTS.items():
        for name, default in FIXTURE[peer][model].items():
            yield peer, model, path, accepted, noops, name, default


def test_every_peer_field_is_honoured_or_listed() -> None:
    unlisted = [f"{peer}.{model}.{name}" for peer, model, _, accepted, noops, name, _ in _cases()
                if name not in accepted and name not in noops]
    assert not unlisted, f"neither honoured nor listed in peer_fields.py: {unlisted}"


def test_every_refusal_is_in_the_api_doc() -> None:
    for name in sorted({*OPENAI_NOOPS, *GENERATE_NOOPS}):
        assert f"`{name}`" in API_DOC, f"docs/api.md: say why {name} is accepted only at its no-op value"


def test_each_peer_field_at_the_peers_default_value(vl_server) -> None:
    url = vl_server.base_url
    failures = []
    with httpx.Client(timeout=60) as client:
        for peer, model, path, accepted, noops, name, default in _cases():
            if name in SET_BY_BASE or default == "required" or (isinstance(default, str) and default.startswith("<")):
                continue
            body = dict(BASE[path], **{name: default})
            r = client.post(url + path, json=body)
            want_refused = REFUSED_AT_PEER_DEFAULT.get((peer, model, name))
            if want_refused:
                ok = r.status_code == 400 and name in r.json()["error"]["message"] and \
                    want_refused in r.json()["error"]["message"]
            else:
                ok = r.status_code == 200
            if not ok:
                failures.append(f"{peer}.{model}.{name}={default!r}: {r.status_code} {r.text[:200]}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(("path", "field", "value", "why"), [
    ("/generate", "lora_id", "my-adapter", "name the LoRA adapter with lora_path"),
    ("/generate", "lora_path", "my-adapter", "this server runs without --enable-lora"),
    ("/v1/chat/completions", "return_hidden_states", True, "hidden states"),
    ("/v1/completions", "priority", 3, "first come, first served"),
])
def test_a_peer_field_that_would_change_the_answer_is_refused_by_name(vl_server, path, field, value, why) -> None:
    r = httpx.post(vl_server.base_url + path, json=dict(BASE[path], **{field: value}), timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(f"{field}: ") and why in message


def test_sglang_bench_serving_native_payload_and_server_info_alias(vl_server) -> None:
    """What SGLang's `bench_serving --backend sglang` sends to /generate (its warm-up was refused before), and
    SGLang's current /server_info name."""
    body = {"text": "Describe the picture.", "sampling_params": {"temperature": 0.0, "max_new_tokens": 4,
                                                                 "ignore_eos": True},
            "stream": True, "return_logprob": False, "logprob_start_len": -1, "lora_path": None,
            "return_routed_experts": False}
    with httpx.stream("POST", vl_server.base_url + "/generate", json=body, timeout=60) as r:
        lines = [x for x in r.iter_lines() if x]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]", lines[-3:]
    chat = dict(BASE["/v1/chat/completions"], return_cached_tokens_details=True)
    usage = httpx.post(vl_server.base_url + "/v1/chat/completions", json=chat, timeout=60).json()["usage"]
    assert "cached_tokens" in usage["prompt_tokens_details"]
    info = httpx.get(vl_server.base_url + "/server_info", timeout=30)
    assert info.status_code == 200 and "stats" in info.json()
