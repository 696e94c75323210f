"""InternVL served end to end: the OpenAI API on a tiny random checkpoint answers exactly as HF generate."""

from __future__ import annotations

import base64
import io
import random

import httpx
import pytest
import torch

from tessera.demo import scenes
from tests.models.internvl_testing import make_tiny_internvl_checkpoint
from tests.server.server_process import ServerProcess

MAX_TOKENS = 8
QUESTION = "What is in the image?"


@pytest.fixture(scope="module")
def internvl_server(tmp_path_factory):
    path = make_tiny_internvl_checkpoint(tmp_path_factory.mktemp("internvl"))
    srv = ServerProcess("--model-path", str(path), "--max-total-tokens", "4096")
    yield srv, path
    srv.stop()


def _data_uri(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _hf_reply(path, images) -> str:
    from transformers import AutoProcessor, InternVLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(path)
    model = InternVLForConditionalGeneration.from_pretrained(path).eval()
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": QUESTION}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    enc = processor(text=[text], images=images, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False)
    return processor.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def test_chat_with_images_matches_hf(internvl_server) -> None:
    from openai import OpenAI

    srv, path = internvl_server
    rng = random.Random(7)
    images = [scenes.image_sample(rng).frames[0].resize(size) for size in ((150, 60), (64, 64))]
    client = OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", timeout=60)
    for used in (images[:1], images):  # one tiled image, then two images in one prompt
        parts = [{"type": "image_url", "image_url": {"url": _data_uri(im)}} for im in used]
        reply = client.chat.completions.create(
            model=path.name, temperature=0, max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}])
        expected = _hf_reply(path, used)
        assert reply.choices[0].message.content == expected
        assert reply.usage.completion_tokens == MAX_TOKENS


def test_model_info(internvl_server) -> None:
    srv, _ = internvl_server
    info = httpx.get(f"{srv.base_url}/model_info", timeout=10).json()
    assert info["architectures"] == ["InternVLForConditionalGeneration"]
    assert info["has_image_understanding"]
    assert not info["has_video_understanding"] and not info["has_audio_understanding"]
