"""A pre-quantized checkpoint served end to end: a compressed-tensors W4A16 (group 32, zero points) Qwen2-VL
answers image chats through the OpenAI API exactly as HF generate on the same checkpoint dequantized,
and /get_server_info names the scheme and what runs it."""

from __future__ import annotations

import random

import httpx

from tessera.demo import scenes
from tests.engine.conftest import make_tiny_checkpoint
from tests.models.quant_fixtures import Scheme, check_quantization_report, quantize_checkpoint
from tests.server.server_process import ServerProcess
from tests.server.vlm_chat import hf_reply, served_reply

MAX_TOKENS = 8


def test_quantized_chat_matches_hf_dequantized(tmp_path) -> None:
    from transformers import Qwen2VLForConditionalGeneration

    src = make_tiny_checkpoint(tmp_path / "float", num_kv_heads=2)
    quantize_checkpoint(src, tmp_path / "quantized", tmp_path / "reference", Scheme("ct-pack"),
                        ["lm_head", "re:.*visual.*"])
    images = [scenes.image_sample(random.Random(5)).frames[0], scenes.image_sample(random.Random(6)).frames[0]]
    srv = ServerProcess("--model-path", str(tmp_path / "quantized"), "--max-total-tokens", "4096")
    try:
        _check_chats(srv.base_url, tmp_path / "reference", images, Qwen2VLForConditionalGeneration)
    finally:
        srv.stop()


def _check_chats(base_url: str, reference, images: list, hf_class) -> None:
    answers = set()
    for used, question in ((images[:1], "What is in the image?"), (images[1:], "What is in the image?"),
                           (images, "Which image has more shapes?")):
        reply = served_reply(base_url, "quantized", used, question, MAX_TOKENS)
        expected = hf_reply(reference, hf_class, used, question, MAX_TOKENS)
        assert reply.choices[0].message.content == expected
        answers.add(expected)
    assert len(answers) == 3, "the reference ignores its inputs"
    effective = httpx.get(f"{base_url}/get_server_info", timeout=10).json()["effective"]
    check_quantization_report(effective["quantization"], "compressed-tensors pack-quantized 4-bit g32 asym")
