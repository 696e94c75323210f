"""A pre-quantized checkpoint served end to end: a compressed-tensors W4A16 (group 32, zero points) Qwen2-VL
answers image chats through the OpenAI API exactly as HF generate on the same checkpoint dequantized,
and /get_server_info names the scheme and what runs it."""

from __future__ import annotations

import random

import httpx
import pytest

from tessera.demo import scenes
from tests.engine.conftest import make_tiny_checkpoint
from tests.models.quant_fixtures import Scheme, check_quantization_report, quantize_checkpoint
from tests.server.server_process import ServerProcess
from tests.server.vlm_chat import hf_reply, served_reply

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def quantized_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized-vl")
    src = make_tiny_checkpoint(root / "float", num_kv_heads=2)
    quantize_checkpoint(src, root / "quantized", root / "reference", Scheme("ct-pack"), ["lm_head", "re:.*visual.*"])
    srv = ServerProcess("--model-path", str(root / "quantized"), "--max-total-tokens", "4096")
    yield srv, root
    srv.stop()


def test_quantized_chat_matches_hf_dequantized(quantized_server) -> None:
    from transformers import Qwen2VLForConditionalGeneration

    srv, root = quantized_server
    rng = random.Random(5)
    images = [scenes.image_sample(rng).frames[0] for _ in range(2)]
    answers = set()
    for used, question in ((images[:1], "What is in the image?"), (images[1:], "What is in the image?"),
                           (images, "Which image has more shapes?")):
        reply = served_reply(srv.base_url, "quantized", used, question, MAX_TOKENS)
        expected = hf_reply(root / "reference", Qwen2VLForConditionalGeneration, used, question, MAX_TOKENS)
        assert reply.choices[0].message.content == expected
        answers.add(expected)
    assert len(answers) == 3, "the reference ignores its inputs"
    effective = httpx.get(f"{srv.base_url}/get_server_info", timeout=10).json()["effective"]
    check_quantization_report(effective["quantization"], "compressed-tensors pack-quantized 4-bit g32 asym")
