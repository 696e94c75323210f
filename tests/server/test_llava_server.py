"""LLaVA-1.5 and LLaVA-NeXT served end to end: the OpenAI API on tiny random checkpoints answers exactly as HF
generate (one image, two images of different aspect ratios in one prompt, then the first request again, which hits
the prefix cache); prefill chunks of 7 tokens split every image; /model_info reports images."""

from __future__ import annotations

import random

import pytest

from tessera.demo import scenes
from tests.models.llava_testing import SPECS, hf_model_class, make_tiny_llava_checkpoint
from tests.server.server_process import ServerProcess
from tests.server.vlm_chat import check_model_info, hf_reply, served_reply

MAX_TOKENS = 8
QUESTION = "What is in the image?"
ARCHITECTURES = {"llama": "LlavaForConditionalGeneration", "next_llama": "LlavaNextForConditionalGeneration"}


@pytest.fixture(scope="module", params=["llama", pytest.param("next_llama", marks=pytest.mark.slow)])
def llava_server(request, tmp_path_factory):
    path = make_tiny_llava_checkpoint(tmp_path_factory.mktemp(f"llava_{request.param}"), request.param)
    srv = ServerProcess("--model-path", str(path), "--max-total-tokens", "4096", "--chunked-prefill-size", "7",
                        "--page-size", "2")
    yield srv, path, request.param
    srv.stop()


def test_chat_with_images_matches_hf(llava_server) -> None:
    srv, path, spec_name = llava_server
    rng = random.Random(11)
    images = [scenes.image_sample(rng).frames[0] for _ in range(2)]
    images[1] = images[1].resize((images[1].width, images[1].height // 3))  # another aspect ratio
    replies = []
    for used in (images[:1], images, images[:1]):
        reply = served_reply(srv.base_url, path.name, used, QUESTION, MAX_TOKENS)
        assert reply.usage.completion_tokens == MAX_TOKENS
        replies.append(reply)
    hf_class = hf_model_class(SPECS[spec_name])
    for used, reply in zip((images[:1], images), replies):
        assert reply.choices[0].message.content == hf_reply(path, hf_class, used, QUESTION, MAX_TOKENS)
    assert replies[2].choices[0].message.content == replies[0].choices[0].message.content
    # The repeat reuses the cached prefix: everything up to the last page boundary before the prompt's end.
    assert replies[2].usage.prompt_tokens_details.cached_tokens >= replies[2].usage.prompt_tokens - 2


def test_model_info_reports_images(llava_server) -> None:
    srv, _, spec_name = llava_server
    check_model_info(srv.base_url, ARCHITECTURES[spec_name])
