"""A family without a native model (LLaVA-OneVision) served by `tessera serve` on the Transformers backend: chats
with images answer as HF generate, streamed as whole, and the sampler's logprobs and grammar masks apply to it."""

from __future__ import annotations

import re

import pytest
import transformers

from tests.models.transformers_backend_testing import FAMILIES, make_checkpoint, random_image
from tests.server.server_process import ServerProcess
from tests.server.vlm_chat import check_image_chats_match_hf, check_model_info, data_uri

ARCHITECTURE = "LlavaOnevisionForConditionalGeneration"
MAX_TOKENS = 8
QUESTION = "What is in the image?"


@pytest.fixture(scope="module")
def backend_server(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("onevision"), FAMILIES[ARCHITECTURE])
    srv = ServerProcess("--model-path", str(path), "--max-total-tokens", "4096")
    yield srv, path
    srv.stop()


def test_chat_with_images_matches_hf(backend_server) -> None:
    srv, path = backend_server
    images = [random_image(1, (40, 56)), random_image(2, (64, 48))]
    check_image_chats_match_hf(srv.base_url, path, getattr(transformers, ARCHITECTURE), (images[:1], images),
                               QUESTION, MAX_TOKENS)
    check_model_info(srv.base_url, ARCHITECTURE, video=True)


def test_streaming_logprobs_and_grammar(backend_server) -> None:
    from openai import OpenAI

    srv, path = backend_server
    client = OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", timeout=60)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(random_image(3, (40, 56)))}},
                                             {"type": "text", "text": QUESTION}]}]
    whole = client.chat.completions.create(model=path.name, messages=messages, temperature=0, max_tokens=MAX_TOKENS,
                                           logprobs=True, top_logprobs=2)
    stream = client.chat.completions.create(model=path.name, messages=messages, temperature=0, max_tokens=MAX_TOKENS,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole.choices[0].message.content
    tokens = whole.choices[0].logprobs.content
    assert len(tokens) == MAX_TOKENS and all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in tokens)
    constrained = client.chat.completions.create(model=path.name, messages=messages, temperature=0, max_tokens=6,
                                                 extra_body={"regex": "(cat|dog) [0-9]+"})
    assert re.fullmatch(r"(cat|dog) [0-9]+", constrained.choices[0].message.content)
