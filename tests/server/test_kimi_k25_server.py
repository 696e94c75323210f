"""Kimi-K2.5 served end to end: the OpenAI API on a tiny random checkpoint (MLA + DeepSeek-V3 MoE text model,
MoonViT tower) answers exactly as HF generate, for one image and for two of different sizes in one prompt."""

from __future__ import annotations

import random

import pytest

from tessera.demo import scenes
from tests.models.kimi_k25_testing import load_hf_reference, make_tiny_kimi_checkpoint
from tests.server.server_process import ServerProcess
from tests.server.vlm_chat import check_model_info, hf_reply, served_reply

MAX_TOKENS = 8
QUESTION = "What is in the image?"


@pytest.fixture(scope="module")
def kimi_server(tmp_path_factory):
    path = make_tiny_kimi_checkpoint(tmp_path_factory.mktemp("kimi"))
    srv = ServerProcess("--model-path", str(path), "--max-total-tokens", "4096")
    yield srv, path
    srv.stop()


def test_chat_with_images_matches_hf(kimi_server) -> None:
    srv, path = kimi_server
    rng = random.Random(7)
    images = [scenes.image_sample(rng).frames[0].resize(size) for size in ((150, 60), (64, 90))]
    for used in (images[:1], images):
        reply = served_reply(srv.base_url, path.name, used, QUESTION, MAX_TOKENS)
        assert reply.choices[0].message.content == hf_reply(path, load_hf_reference, used, QUESTION, MAX_TOKENS)
        assert reply.usage.completion_tokens == MAX_TOKENS


def test_model_info(kimi_server) -> None:
    srv, _ = kimi_server
    check_model_info(srv.base_url, "Kimi_K25ForConditionalGeneration")
