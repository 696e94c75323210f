"""Qwen3-VL-MoE served end to end: the OpenAI API on a tiny random checkpoint (MoE and dense text layers,
DeepStack) answers exactly as HF generate, for one image and for two images of other shapes; prefill chunks of 16
tokens split the images across chunks."""

from __future__ import annotations

import random

import pytest

from tessera.demo import scenes
from tests.models.qwen3_vl_moe_testing import make_tiny_qwen3_vl_moe_checkpoint
from tests.models.qwen3_vl_testing import load_hf_reference
from tests.server.server_process import ServerProcess
from tests.server.vlm_chat import check_image_chats_match_hf, check_model_info

MAX_TOKENS = 8
QUESTION = "What is in the image?"


@pytest.fixture(scope="module")
def qwen3_vl_moe_server(tmp_path_factory):
    path = make_tiny_qwen3_vl_moe_checkpoint(tmp_path_factory.mktemp("qwen3_vl_moe"))
    srv = ServerProcess("--model-path", str(path), "--max-total-tokens", "4096", "--chunked-prefill-size", "16")
    yield srv, path
    srv.stop()


def test_chat_with_images_matches_hf(qwen3_vl_moe_server) -> None:
    srv, path = qwen3_vl_moe_server
    rng = random.Random(7)
    images = [scenes.image_sample(rng).frames[0] for _ in range(2)]
    image_sets = (images[:1], [images[1].resize((96, 160)), images[0]])
    check_image_chats_match_hf(srv.base_url, path, load_hf_reference, image_sets, QUESTION, MAX_TOKENS)


def test_model_info(qwen3_vl_moe_server) -> None:
    srv, _ = qwen3_vl_moe_server
    check_model_info(srv.base_url, "Qwen3VLMoeForConditionalGeneration", video=True)
