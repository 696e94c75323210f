"""Gemma-3 served end to end: the OpenAI API on a tiny random checkpoint answers exactly as HF generate, and
/model_info reports image input only."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
import torch

from tests.models.gemma3_testing import SPECS, load_hf_reference, make_tiny_gemma3_checkpoint
from tests.server.server_process import ServerProcess

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def gemma3_server(tmp_path_factory):
    path = make_tiny_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3"), SPECS["gqa"], seed=4)
    # Chunks smaller than an image: the scheduler keeps each image's bidirectional span in one chunk.
    srv = ServerProcess("--model-path", str(path), "--max-total-tokens", "4096", "--chunked-prefill-size", "8")
    yield srv, path
    srv.stop()


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _hf_reply(path, images, question: str) -> str:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    model = load_hf_reference(path)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    enc = processor(text=[text], images=images, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False)
    return processor.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def test_chat_with_images_matches_hf(gemma3_server) -> None:
    from openai import OpenAI
    from PIL import Image

    srv, path = gemma3_server
    rng = np.random.default_rng(5)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((48, 80), (64, 64))]
    client = OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", timeout=60)
    for used in (images[:1], images):  # one image, then two images in one prompt
        parts = [{"type": "image_url",
                  "image_url": {"url": "data:image/png;base64," + base64.b64encode(_png(im)).decode()}} for im in used]
        reply = client.chat.completions.create(
            model=path.name, temperature=0, max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "What is in the image?"}]}])
        expected = _hf_reply(path, used, "What is in the image?")
        assert expected and reply.choices[0].message.content == expected


def test_model_info(gemma3_server) -> None:
    srv, _ = gemma3_server
    info = httpx.get(f"{srv.base_url}/model_info", timeout=10).json()
    assert info["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert info["has_image_understanding"]
    assert not info["has_video_understanding"] and not info["has_audio_understanding"]
