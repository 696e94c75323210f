"""LLaVA-1.5 and LLaVA-NeXT served end to end: the OpenAI API on tiny random checkpoints answers exactly as HF
generate (one image, two images of different aspect ratios in one prompt, then the first request again, which hits
the prefix cache); prefill chunks of 7 tokens split every image; /model_info reports images."""

from __future__ import annotations

import base64
import io
import random

import httpx
import pytest
import torch

from tessera.demo import scenes
from tests.models.llava_testing import SPECS, hf_model_class, make_tiny_llava_checkpoint
from tests.server.server_process import ServerProcess

MAX_TOKENS = 8
ARCHITECTURES = {"llama": "LlavaForConditionalGeneration", "next_llama": "LlavaNextForConditionalGeneration"}


@pytest.fixture(scope="module", params=["llama", pytest.param("next_llama", marks=pytest.mark.slow)])
def llava_server(request, tmp_path_factory):
    path = make_tiny_llava_checkpoint(tmp_path_factory.mktemp(f"llava_{request.param}"), request.param)
    srv = ServerProcess("--model-path", str(path), "--max-total-tokens", "4096", "--chunked-prefill-size", "7",
                        "--page-size", "2")
    yield srv, path, request.param
    srv.stop()


def _data_uri(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _hf_reply(path, spec_name: str, images, question: str) -> str:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    model = hf_model_class(SPECS[spec_name]).from_pretrained(path).eval()
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    enc = processor(text=[text], images=images, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False)
    return processor.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def test_chat_with_images_matches_hf(llava_server) -> None:
    from openai import OpenAI

    srv, path, spec_name = llava_server
    rng = random.Random(11)
    images = [scenes.image_sample(rng).frames[0] for _ in range(2)]
    images[1] = images[1].resize((images[1].width, images[1].height // 3))  # another aspect ratio
    client = OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", timeout=60)
    replies = []
    for used in (images[:1], images, images[:1]):
        parts = [{"type": "image_url", "image_url": {"url": _data_uri(im)}} for im in used]
        reply = client.chat.completions.create(
            model=path.name, temperature=0, max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": [*parts, {"type": "text", "text": "What is in the image?"}]}])
        assert reply.usage.completion_tokens == MAX_TOKENS
        replies.append(reply)
    for used, reply in zip((images[:1], images), replies):
        assert reply.choices[0].message.content == _hf_reply(path, spec_name, used, "What is in the image?")
    assert replies[2].choices[0].message.content == replies[0].choices[0].message.content
    # The repeat reuses the cached prefix: everything up to the last page boundary before the prompt's end.
    assert replies[2].usage.prompt_tokens_details.cached_tokens >= replies[2].usage.prompt_tokens - 2


def test_model_info_reports_images(llava_server) -> None:
    srv, _, spec_name = llava_server
    info = httpx.get(f"{srv.base_url}/model_info", timeout=10).json()
    assert info["architectures"] == [ARCHITECTURES[spec_name]]
    assert info["has_image_understanding"]
    assert not info["has_video_understanding"] and not info["has_audio_understanding"]
