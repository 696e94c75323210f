"""Prompt logprobs over HTTP: /v1/completions echo x logprobs (stream or not, text or token ids, n 1 or 2)
in the shapes SGLang's and vLLM's own tests assert, max_tokens 0 with echo, SGLang's /generate
input_token_logprobs (their values are the engine's: tests/engine/test_prompt_logprobs.py checks them on HF), and
vLLM's prompt_logprobs on completions and chat, checked here on HF's fp32 log_softmax (values, ranks, top-k)."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from tessera.config import ASSETS_DIR
from tests.engine.hf_reference import chat_prompt

PROMPT = "The circle is red and the square is"


@pytest.fixture(scope="module")
def client(vl_server):
    return openai.OpenAI(base_url=f"{vl_server.base_url}/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def prompt_ids(client, vl_server) -> list[int]:
    r = httpx.post(f"{vl_server.base_url}/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def check_echo_logprobs(lp, num_prompt: int, num_out: int, logprobs: int) -> None:
    """vLLM's test_echo_logprob_completion and SGLang's run_completion, on the merged (streamed) pieces."""
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == \
        num_prompt + num_out
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    for top in lp.top_logprobs[1:]:
        assert max(logprobs, 1) <= len(top) <= logprobs + 1
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("as_ids", [False, True])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("echo,logprobs", [(True, 1), (True, None), (False, 2), (False, None)])
def test_completion_echo_logprobs_matrix(client, prompt_ids, stream, as_ids, n, echo, logprobs):
    prompt = prompt_ids if as_ids else PROMPT
    kw = dict(model="demo-vl", prompt=prompt, max_tokens=3, temperature=0, n=n, echo=echo, logprobs=logprobs,
              extra_body={"ignore_eos": True})
    if not stream:
        choices = client.completions.create(**kw).choices
        texts = {c.index: c.text for c in choices}
        lps = {c.index: c.logprobs for c in choices}
    else:
        texts, lps, first = {}, {}, set()
        for chunk in client.completions.create(**kw, stream=True):
            for c in chunk.choices:
                if c.index not in first:
                    first.add(c.index)
                    if echo:  # SGLang's stream test: the first chunk starts with the prompt
                        assert c.text.startswith(PROMPT)
                texts[c.index] = texts.get(c.index, "") + c.text
                if logprobs is not None:  # every chunk carries tokens (SGLang reads tokens[0])
                    assert c.logprobs is not None and isinstance(c.logprobs.tokens[0], str)
                    merged = lps.setdefault(c.index, {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                      "text_offset": []})
                    for key in merged:
                        merged[key] += getattr(c.logprobs, key)
        lps = {i: SimpleNamespace(**m) for i, m in lps.items()} if logprobs else lps
    assert sorted(texts) == list(range(n))
    for i in range(n):
        assert texts[i].startswith(PROMPT) == echo
        if logprobs is None:
            assert lps.get(i) is None
        elif echo:
            check_echo_logprobs(lps[i], len(prompt_ids), 3, logprobs)
        else:
            assert len(lps[i].tokens) == 3 and lps[i].token_logprobs[0] is not None


def test_echo_prompt_logprobs_agree_across_shapes_and_max_tokens_zero(client, prompt_ids):
    full = client.completions.create(model="demo-vl", prompt=PROMPT, max_tokens=2, temperature=0, echo=True,
                                     logprobs=2).choices[0].logprobs
    only = client.completions.create(model="demo-vl", prompt=[prompt_ids, prompt_ids[:4]], max_tokens=0, echo=True,
                                     logprobs=2)
    assert [c.text for c in only.choices] == [PROMPT, client.completions.create(
        model="demo-vl", prompt=[prompt_ids[:4]], max_tokens=0, echo=True).choices[0].text]
    lp = only.choices[0].logprobs
    assert lp.tokens == full.tokens[:len(prompt_ids)]
    assert lp.token_logprobs[1:] == pytest.approx(full.token_logprobs[1:len(prompt_ids)], abs=1e-5)
    assert len(only.choices[1].logprobs.tokens) == 4 and only.usage.completion_tokens == 0


def test_native_generate_input_logprobs(vl_server, prompt_ids):
    body = {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True, "top_logprobs_num": 2, "return_text_in_logprobs": True}
    r = httpx.post(f"{vl_server.base_url}/generate", json={**body, "logprob_start_len": 0}, timeout=60)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == prompt_ids
    assert meta["input_token_logprobs"][0][0] is None and meta["input_top_logprobs"][0] is None
    for (lp, _, text), top in zip(meta["input_token_logprobs"][1:], meta["input_top_logprobs"][1:]):
        assert isinstance(text, str) and len(top) == 2 and top[0][0] >= top[1][0] and lp <= top[0][0] + 1e-6
    later = httpx.post(f"{vl_server.base_url}/generate", json={**body, "logprob_start_len": 3}, timeout=60).json()
    # The same rows, recomputed over a shorter extent (the prefix may come from the cache): equal up to fp32
    # rounding of a differently blocked product.
    got, want = later["meta_info"]["input_token_logprobs"], meta["input_token_logprobs"][3:]
    assert [row[1:] for row in got] == [row[1:] for row in want]
    assert all(abs(a[0] - b[0]) < 1e-4 for a, b in zip(got, want))
    plain = httpx.post(f"{vl_server.base_url}/generate", json=body, timeout=60).json()["meta_info"]
    assert plain["input_token_logprobs"] == [] and plain["input_top_logprobs"] == []
    bad = httpx.post(f"{vl_server.base_url}/generate", json={**body, "logprob_start_len": len(prompt_ids)},
                     timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprob_start_len", bad.text


@pytest.mark.parametrize("n", [1, 2])
def test_chat_stream_logprobs_chunk_shapes_with_an_image(client, vl_media_dir, n):
    """SGLang's run_chat_completion_stream: after each choice's role chunk, every chunk before its finish
    carries content and logprobs with exactly top_logprobs alternatives; none has neither content nor
    finish_reason."""
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": str(vl_media_dir / "scene.png")}},
        {"type": "text", "text": "What color is the circle? Describe the picture."}]}]
    stream = client.chat.completions.create(model="demo-vl", messages=messages, max_tokens=12, n=n, temperature=1.0,
                                            seed=3, logprobs=True, top_logprobs=5, stream=True)
    first, finished, tokens, texts = set(), {}, {}, {}
    for chunk in stream:
        c = chunk.choices[0]
        if c.index not in first:
            first.add(c.index)
            assert c.delta.role == "assistant"
            continue
        if c.finish_reason is not None:
            finished[c.index] = finished.get(c.index, 0) + 1
        else:
            assert isinstance(c.delta.content, str) and c.delta.content
            assert c.logprobs and c.logprobs.content
            assert all(len(t.top_logprobs) == 5 and isinstance(t.top_logprobs[0].token, str)
                       for t in c.logprobs.content)
        if c.logprobs:
            tokens[c.index] = tokens.get(c.index, 0) + len(c.logprobs.content)
        texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    assert finished == {i: 1 for i in range(n)}
    assert sorted(tokens) == list(range(n)) and all(0 < t <= 12 for t in tokens.values())


@pytest.fixture(scope="module")
def hf_demo():
    from transformers import AutoModelForImageTextToText, AutoProcessor

    demo = ASSETS_DIR / "demo-vl"
    return AutoModelForImageTextToText.from_pretrained(demo, dtype=torch.float32).eval(), \
        AutoProcessor.from_pretrained(demo)


@torch.no_grad()
def hf_log_softmax(hf_demo, enc: dict) -> torch.Tensor:
    return torch.log_softmax(hf_demo[0](**enc).logits[0].float(), dim=-1)


def check_vllm_prompt_logprobs(got: list, ids: list[int], lp: torch.Tensor, k: int) -> None:
    """vLLM's shape: None, then per token {id: {logprob, rank, decoded_token}}: the prompt token first (its rank
    among the vocabulary), then the k most likely ranked 1..k; values as HF's."""
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        entry = {int(t): v for t, v in got[p].items()}
        first = next(iter(entry))
        assert first == ids[p] and isinstance(entry[first]["decoded_token"], str)
        row = lp[p - 1]
        value = row[ids[p]].item()
        assert entry[first]["logprob"] == pytest.approx(value, abs=1e-3)
        # near-ties may order either way between two implementations
        assert (row > value + 1e-4).sum().item() + 1 <= entry[first]["rank"] <= (row >= value - 1e-4).sum().item()
        want_v, want_i = row.topk(k)
        alts = {t: v for t, v in entry.items() if t != first or v["rank"] <= k}
        assert len(entry) == k + (ids[p] not in want_i.tolist())
        for rank, (v, t) in enumerate(zip(want_v.tolist(), want_i.tolist()), start=1):
            if t == first:
                continue
            assert alts[t]["rank"] == rank and alts[t]["logprob"] == pytest.approx(v, abs=1e-3)


def test_vllm_prompt_logprobs_on_completions_equal_hf(vl_server, prompt_ids, hf_demo):
    lp = hf_log_softmax(hf_demo, {"input_ids": torch.tensor([prompt_ids])})
    body = {"model": "demo-vl", "prompt": [prompt_ids, prompt_ids[:5]], "max_tokens": 2, "temperature": 0, "n": 2,
            "logprobs": 1, "prompt_logprobs": 3}
    r = httpx.post(f"{vl_server.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 4
    for c in choices:
        ids = prompt_ids if c["index"] < 2 else prompt_ids[:5]
        check_vllm_prompt_logprobs(c["prompt_logprobs"], ids, lp, 3)
        # the output keeps the one alternative `logprobs` asked (and the chosen token), not prompt_logprobs' 3
        assert len(c["logprobs"]["tokens"]) == 2 and all(len(t) <= 2 for t in c["logprobs"]["top_logprobs"])
    # without prompt_logprobs the field is absent, and prompt_logprobs 0 is the prompt token alone
    plain = httpx.post(f"{vl_server.base_url}/v1/completions", json={**body, "prompt_logprobs": None}, timeout=60)
    assert "prompt_logprobs" not in plain.json()["choices"][0]
    alone = httpx.post(f"{vl_server.base_url}/v1/completions", timeout=60,
                       json={**body, "prompt": prompt_ids, "n": 1, "logprobs": None, "prompt_logprobs": 0}).json()
    got = alone["choices"][0]["prompt_logprobs"]
    assert alone["choices"][0]["logprobs"] is None and [list(e) for e in got[1:]] == [[str(t)] for t in prompt_ids[1:]]


def test_vllm_prompt_logprobs_on_chat_with_an_image_equal_hf(vl_server, vl_media_dir, hf_demo):
    from PIL import Image

    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": str(vl_media_dir / "scene.png")}},
        {"type": "text", "text": "What color is the circle?"}]}]
    r = httpx.post(f"{vl_server.base_url}/v1/chat/completions", timeout=60, json={
        "model": "demo-vl", "messages": messages, "max_tokens": 2, "temperature": 0, "n": 2, "prompt_logprobs": 2})
    assert r.status_code == 200, r.text
    reply = r.json()
    got = reply["prompt_logprobs"]
    assert len(got) == reply["usage"]["prompt_tokens"] and all("prompt_logprobs" not in c for c in reply["choices"])
    assert all(c["logprobs"] is None for c in reply["choices"])
    image = Image.open(vl_media_dir / "scene.png").convert("RGB")
    enc = hf_demo[1](text=[chat_prompt(hf_demo[1], 1, "What color is the circle?")], images=[image],
                     return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    assert [int(next(iter(e))) for e in got[1:]] == ids[1:]
    check_vllm_prompt_logprobs(got, ids, hf_log_softmax(hf_demo, enc), 2)


def test_chat_stream_echo_with_logprobs_chunks_carry_content(client):
    """vLLM's chat echo: the assistant's prefilled text comes back first, as content without logprobs (they
    cover generated tokens only); every later chunk has content or a finish_reason."""
    messages = [{"role": "user", "content": "Describe the picture."}, {"role": "assistant", "content": "The circle"}]
    stream = client.chat.completions.create(model="demo-vl", messages=messages, max_tokens=6, temperature=0,
                                            logprobs=True, top_logprobs=5, stream=True, n=2,
                                            extra_body={"echo": True, "continue_final_message": True,
                                                        "add_generation_prompt": False, "ignore_eos": True})
    seen: dict[int, list] = {}
    for chunk in stream:
        c = chunk.choices[0]
        seen.setdefault(c.index, []).append(c)
    assert sorted(seen) == [0, 1]
    for chunks in seen.values():
        assert chunks[0].delta.role == "assistant"
        assert chunks[1].delta.content == "The circle" and chunks[1].logprobs is None
        assert all(c.delta.content or c.finish_reason for c in chunks[1:])
        assert sum(len(c.logprobs.content) for c in chunks[2:] if c.logprobs) == 6
        assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"]
