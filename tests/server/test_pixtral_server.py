"""Pixtral (LLaVA with a Pixtral tower) served end to end: the OpenAI API on a tiny random checkpoint answers
exactly as HF generate."""

from __future__ import annotations

import random

import pytest

from tessera.demo import scenes
from tests.models.pixtral_testing import make_tiny_pixtral_checkpoint
from tests.server.server_process import ServerProcess
from tests.server.vlm_chat import check_model_info, hf_reply, served_reply

MAX_TOKENS = 8
QUESTION = "What is in the image?"


@pytest.fixture(scope="module")
def pixtral_server(tmp_path_factory):
    path = make_tiny_pixtral_checkpoint(tmp_path_factory.mktemp("pixtral"))
    srv = ServerProcess("--model-path", str(path), "--max-total-tokens", "4096")
    yield srv, path
    srv.stop()


def test_chat_with_images_matches_hf(pixtral_server) -> None:
    from transformers import LlavaForConditionalGeneration

    srv, path = pixtral_server
    rng = random.Random(7)
    images = [scenes.image_sample(rng).frames[0].resize(size) for size in ((150, 60), (64, 64))]
    for used in (images[:1], images):  # one image, then two of different sizes in one prompt
        reply = served_reply(srv.base_url, path.name, used, QUESTION, MAX_TOKENS)
        expected = hf_reply(path, LlavaForConditionalGeneration, used, QUESTION, MAX_TOKENS)
        assert reply.choices[0].message.content == expected
        assert reply.usage.completion_tokens == MAX_TOKENS


def test_model_info(pixtral_server) -> None:
    srv, _ = pixtral_server
    check_model_info(srv.base_url, "LlavaForConditionalGeneration")
