"""`tessera serve` of a tiny CLIP checkpoint (an embedding-only architecture: embedding mode by itself, warm-up
included): /v1/embeddings gives the text tower's features for text (through the `openai` client) and the image
tower's for an image (SGLang's {image} input and vLLM's messages form); generation is refused by name."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from tests.models.clip_testing import make_tiny_clip
from tests.server.server_process import ServerProcess


@pytest.fixture(scope="module")
def clip_server(tmp_path_factory):
    from transformers import AutoProcessor

    path = tmp_path_factory.mktemp("tiny-clip-server")
    hf = make_tiny_clip(path, seed=2)
    srv = ServerProcess("--model-path", str(path), "--max-total-tokens", "1024")
    yield srv, hf, AutoProcessor.from_pretrained(path)
    srv.stop()


def unit(v) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    return v / np.linalg.norm(v)


def test_text_and_image_embeddings_match_clip(clip_server):
    from openai import OpenAI

    srv, hf, processor = clip_server
    texts = ["the red circle", "a blue square"]
    with torch.no_grad():
        refs = hf.get_text_features(**processor.tokenizer(texts, padding=True, return_tensors="pt")).pooler_output
    res = OpenAI(base_url=f"{srv.base_url}/v1", api_key="none").embeddings.create(model="default", input=texts)
    for d, ref in zip(res.data, refs):
        assert np.abs(np.asarray(d.embedding) - unit(ref.numpy())).max() <= 1e-4
    image = Image.fromarray(np.random.default_rng(4).integers(0, 256, (48, 40, 3), dtype=np.uint8))
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    with torch.no_grad():
        ref = hf.get_image_features(**processor.image_processor(images=[image], return_tensors="pt")).pooler_output[0]
    sglang_form = httpx.post(f"{srv.base_url}/v1/embeddings", json={"input": [{"image": uri}]}, timeout=60)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}}]}]
    vllm_form = httpx.post(f"{srv.base_url}/v1/embeddings", json={"messages": messages}, timeout=60)
    for r in (sglang_form, vllm_form):
        assert r.status_code == 200, r.text
        assert np.abs(np.asarray(r.json()["data"][0]["embedding"]) - unit(ref.numpy())).max() <= 1e-4
    assert httpx.get(f"{srv.base_url}/model_info").json()["is_generation"] is False
    completion = httpx.post(f"{srv.base_url}/v1/completions", json={"prompt": "the cat", "max_tokens": 2})
    assert completion.status_code == 400 and "embedding model" in completion.json()["error"]["message"]
    both = httpx.post(f"{srv.base_url}/v1/embeddings", json={"input": [{"text": "a cat", "image": uri}]})
    assert both.status_code == 400 and both.json()["error"]["param"] == "input"
