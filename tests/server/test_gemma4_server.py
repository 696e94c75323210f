"""Gemma 4 served end to end: the OpenAI API on a tiny random checkpoint answers exactly as HF generate (one
image, then two of other aspect ratios; prefill chunks smaller than an image), and /model_info reports image, video
and audio input (the checkpoint has an audio tower)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.models.gemma4_testing import load_hf_reference, make_tiny_gemma4_checkpoint
from tests.server.server_process import ServerProcess
from tests.server.vlm_chat import check_model_info, hf_reply, served_reply

MAX_TOKENS = 8
QUESTION = "What is in the image?"


@pytest.fixture(scope="module")
def gemma4_server(tmp_path_factory):
    path = make_tiny_gemma4_checkpoint(tmp_path_factory.mktemp("gemma4"))
    # Chunks smaller than an image: the scheduler keeps each image's bidirectional span in one chunk.
    srv = ServerProcess("--model-path", str(path), "--max-total-tokens", "4096", "--chunked-prefill-size", "16")
    yield srv, path
    srv.stop()


def test_chat_with_images_matches_hf(gemma4_server) -> None:
    from PIL import Image

    srv, path = gemma4_server
    rng = np.random.default_rng(5)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((48, 80), (64, 30))]
    for used in (images[:1], images):  # one image, then two images in one prompt
        reply = served_reply(srv.base_url, path.name, used, QUESTION, MAX_TOKENS)
        expected = hf_reply(path, load_hf_reference, used, QUESTION, MAX_TOKENS)
        assert expected and reply.choices[0].message.content == expected


def test_model_info(gemma4_server) -> None:
    srv, _ = gemma4_server
    check_model_info(srv.base_url, "Gemma4ForConditionalGeneration", video=True, audio=True)
