"""Qwen2.5-VL served end to end: the OpenAI API on a tiny random checkpoint answers exactly as HF generate."""

from __future__ import annotations

import random

import httpx
import pytest

from tessera.demo import scenes
from tests.models.qwen2_5_vl_testing import make_tiny_qwen2_5_vl_checkpoint
from tests.server.server_process import ServerProcess
from tests.server.vlm_chat import check_model_info, hf_reply, served_reply

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def qwen25_server(tmp_path_factory):
    path = make_tiny_qwen2_5_vl_checkpoint(tmp_path_factory.mktemp("qwen2_5_vl"))
    srv = ServerProcess("--model-path", str(path), "--max-total-tokens", "4096")
    yield srv, path
    srv.stop()


def test_chat_with_images_matches_hf(qwen25_server) -> None:
    from transformers import Qwen2_5_VLForConditionalGeneration

    srv, path = qwen25_server
    rng = random.Random(7)
    images = [scenes.image_sample(rng).frames[0] for _ in range(2)]
    for used in (images[:1], images):  # one image, then two images in one prompt
        reply = served_reply(srv.base_url, path.name, used, "What is in the image?", MAX_TOKENS)
        expected = hf_reply(path, Qwen2_5_VLForConditionalGeneration, used, "What is in the image?", MAX_TOKENS)
        assert reply.choices[0].message.content == expected
        assert reply.usage.completion_tokens == MAX_TOKENS


def test_model_info_and_server_info(qwen25_server) -> None:
    srv, _ = qwen25_server
    check_model_info(srv.base_url, "Qwen2_5_VLForConditionalGeneration", video=True)
    server = httpx.get(f"{srv.base_url}/get_server_info", timeout=10).json()
    effective = server["effective"]
    assert effective["device"] == "cpu" and effective["dtype"] == "float32"  # the checkpoint's dtype
    assert effective["max_total_tokens"] == 4096 and effective["decode_kv_mirror"] is True
    assert server["server_args"]["dtype"] == "auto" and "api_key" not in server["server_args"]
    assert (server["device"], server["dtype"], server["max_total_num_tokens"]) == ("cpu", "float32", 4096)
