"""Llama-4 served end to end: the OpenAI API on a tiny random checkpoint (MoE, chunked attention, NoPE layers;
images of one tile and of several tiles plus the global image) answers exactly as HF generate."""

from __future__ import annotations

import random

import pytest

from tessera.demo import scenes
from tests.models.llama4_testing import load_hf_reference, make_tiny_llama4_checkpoint
from tests.server.server_process import ServerProcess
from tests.server.vlm_chat import check_image_chats_match_hf, check_model_info

MAX_TOKENS = 8
QUESTION = "What is in the image?"


@pytest.fixture(scope="module")
def llama4_server(tmp_path_factory):
    path = make_tiny_llama4_checkpoint(tmp_path_factory.mktemp("llama4"))
    srv = ServerProcess("--model-path", str(path), "--max-total-tokens", "4096")
    yield srv, path
    srv.stop()


def test_chat_with_images_matches_hf(llama4_server) -> None:
    srv, path = llama4_server
    rng = random.Random(7)
    images = [scenes.image_sample(rng).frames[0].resize(size) for size in ((90, 40), (28, 28))]
    # A tiled image, then two images (tiled + one tile) in one prompt
    check_image_chats_match_hf(srv.base_url, path, load_hf_reference, (images[:1], images), QUESTION, MAX_TOKENS)


def test_model_info(llama4_server) -> None:
    srv, _ = llama4_server
    check_model_info(srv.base_url, "Llama4ForConditionalGeneration")
