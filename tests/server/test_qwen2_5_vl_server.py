"""Qwen2.5-VL served end to end: the OpenAI API on a tiny random checkpoint answers exactly as HF generate."""

from __future__ import annotations

import base64
import random

import httpx
import pytest
import torch

from tessera.demo import scenes
from tests.models.qwen2_5_vl_testing import make_tiny_qwen2_5_vl_checkpoint
from tests.server.server_process import ServerProcess

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def qwen25_server(tmp_path_factory):
    path = make_tiny_qwen2_5_vl_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl"))
    srv = ServerProcess("--model-path", str(path), "--max-total-tokens", "4096")
    yield srv, path
    srv.stop()


def _png(image) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _hf_reply(path, images, question: str) -> str:
    from transformers import AutoProcessor, Qwen2_5_VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(path)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(path).eval()
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    enc = processor(text=[text], images=images, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False)
    return processor.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def test_chat_with_images_matches_hf(qwen25_server) -> None:
    from openai import OpenAI

    srv, path = qwen25_server
    rng = random.Random(7)
    images = [scenes.image_sample(rng).frames[0] for _ in range(2)]
    client = OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", timeout=60)
    for used in (images[:1], images):  # one image, then two images in one prompt
        parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(_png(im)).decode()}}
                 for im in used]
        reply = client.chat.completions.create(
            model=path.name, temperature=0, max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "What is in the image?"}]}])
        assert reply.choices[0].message.content == _hf_reply(path, used, "What is in the image?")
        assert reply.usage.completion_tokens == MAX_TOKENS


def test_model_info_and_server_info(qwen25_server) -> None:
    srv, _ = qwen25_server
    info = httpx.get(f"{srv.base_url}/model_info", timeout=10).json()
    assert info["architectures"] == ["Qwen2_5_VLForConditionalGeneration"]
    assert info["has_image_understanding"] and info["has_video_understanding"]
    assert not info["has_audio_understanding"]
    server = httpx.get(f"{srv.base_url}/get_server_info", timeout=10).json()
    effective = server["effective"]
    assert effective["device"] == "cpu" and effective["dtype"] == "float32"  # the checkpoint's dtype
    assert effective["max_total_tokens"] == 4096 and effective["decode_kv_mirror"] is True
    assert server["server_args"]["dtype"] == "auto" and "api_key" not in server["server_args"]
    assert (server["device"], server["dtype"], server["max_total_num_tokens"]) == ("cpu", "float32", 4096)
