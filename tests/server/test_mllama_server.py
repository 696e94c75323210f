"""Llama-3.2-Vision (Mllama) served end to end: the OpenAI API on a tiny random checkpoint (cross-attention layers
over each request's tiled images, after the server's own warm-up) answers exactly as HF generate."""

from __future__ import annotations

import random

import pytest

from tessera.demo import scenes
from tests.models.mllama_testing import load_hf_reference, make_tiny_mllama_checkpoint
from tests.server.server_process import ServerProcess
from tests.server.vlm_chat import check_model_info, hf_reply, served_reply

MAX_TOKENS = 8
QUESTION = "What is in the image?"


@pytest.fixture(scope="module")
def mllama_server(tmp_path_factory):
    path = make_tiny_mllama_checkpoint(tmp_path_factory.mktemp("mllama"))
    srv = ServerProcess("--model-path", str(path), "--max-total-tokens", "4096")
    yield srv, path
    srv.stop()


def test_chat_with_images_matches_hf(mllama_server) -> None:
    srv, path = mllama_server
    rng = random.Random(7)
    wide, small, square = (scenes.image_sample(rng).frames[0].resize(size) for size in ((90, 40), (28, 28), (60, 60)))
    answers = []
    for used in ([small], [wide, square]):  # one tile, then two tiled images in one prompt
        reply = served_reply(srv.base_url, path.name, used, QUESTION, MAX_TOKENS)
        expected = hf_reply(path, load_hf_reference, used, QUESTION, MAX_TOKENS)
        assert reply.choices[0].message.content == expected
        answers.append(expected)
    assert answers[0] != answers[1], "the answer does not depend on the images"


def test_model_info(mllama_server) -> None:
    srv, _ = mllama_server
    check_model_info(srv.base_url, "MllamaForConditionalGeneration")
