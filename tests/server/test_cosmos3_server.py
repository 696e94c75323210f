"""Cosmos3-Edge served end to end: the OpenAI API on a tiny random checkpoint in its own layout answers exactly as
HF generate (one image, two images of other shapes, a video as timestamped frames; prefill chunks of 16 tokens
split them); and the checkpoint as a Diffusers pipeline served with `--model-type llm --language-model-only`, as
the seed document runs Cosmos3-Nano: /model_info reports no image or video input, media are a 400 naming the
flag, text is answered."""

from __future__ import annotations

import base64
import random

import httpx
import pytest

from tessera.demo import scenes
from tessera.multimodal.media import MediaLimits, load_video
from tests.models.cosmos3_testing import (EDGE, as_diffusers_layout, load_hf_reference,
                                          make_tiny_cosmos3_edge_checkpoint)
from tests.multimodal.conftest import encode_mp4
from tests.server.server_process import ServerProcess
from tests.server.vlm_chat import check_model_info, data_uri, hf_chat_reply

MAX_TOKENS = 8
NUM_FRAMES = 4


@pytest.fixture(scope="module")
def cosmos3_server(tmp_path_factory):
    path = make_tiny_cosmos3_edge_checkpoint(tmp_path_factory.mktemp("cosmos3_edge"))
    srv = ServerProcess("--model-path", str(path), "--max-total-tokens", "4096", "--chunked-prefill-size", "16",
                        "--page-size", "4", "--mm-process-config", f'{{"video": {{"num_frames": {NUM_FRAMES}}}}}')
    yield srv, path
    srv.stop()


def _hf_reply(processor, model, content: list, images=None, clip=None) -> tuple[str, int]:
    return hf_chat_reply(processor, model, content, MAX_TOKENS, images, clip)


def test_chat_matches_hf(cosmos3_server) -> None:
    from openai import OpenAI
    from transformers import AutoProcessor

    srv, path = cosmos3_server
    processor, model = AutoProcessor.from_pretrained(path), load_hf_reference(path)
    client = OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", timeout=60)

    def ask(parts: list, question: str):
        return client.chat.completions.create(model=path.name, temperature=0, max_tokens=MAX_TOKENS, messages=[
            {"role": "user", "content": [*parts, {"type": "text", "text": question}]}])

    rng = random.Random(7)
    images = [scenes.image_sample(rng).frames[0] for _ in range(2)]
    answers = []
    for used in (images[:1], [images[1].resize((96, 160)), images[0]]):
        reply = ask([{"type": "image_url", "image_url": {"url": data_uri(im)}} for im in used], "What is here?")
        content = [{"type": "image"} for _ in used] + [{"type": "text", "text": "What is here?"}]
        assert (reply.choices[0].message.content, reply.usage.prompt_tokens) == _hf_reply(processor, model, content,
                                                                                          images=used)
        answers.append(reply.choices[0].message.content)
    assert answers[0] != answers[1]

    mp4 = encode_mp4([f.resize((64, 64)) for f in scenes.video_sample(random.Random(3)).frames], fps=5)
    clip = load_video(mp4, limits=MediaLimits(), num_frames=NUM_FRAMES)  # the frames the server samples
    video_uri = "data:video/mp4;base64," + base64.b64encode(mp4).decode()
    reply = ask([{"type": "video_url", "video_url": {"url": video_uri}}], "Which way is it moving?")
    content = [{"type": "video"}, {"type": "text", "text": "Which way is it moving?"}]
    assert (reply.choices[0].message.content, reply.usage.prompt_tokens) == _hf_reply(processor, model, content,
                                                                                      clip=clip)
    check_model_info(srv.base_url, EDGE, video=True)


def test_model_type_llm_language_model_only(tmp_path) -> None:
    path = as_diffusers_layout(make_tiny_cosmos3_edge_checkpoint(tmp_path / "cosmos3_pipeline"))
    srv = ServerProcess("--model-path", str(path), "--model-type", "llm", "--language-model-only",
                        "--max-total-tokens", "2048", "--skip-server-warmup")
    try:
        info = httpx.get(f"{srv.base_url}/model_info", timeout=10).json()
        assert info["architectures"] == [EDGE]
        assert info["has_image_understanding"] is False and info["has_video_understanding"] is False
        image = scenes.image_sample(random.Random(1)).frames[0]
        for part in ({"type": "image_url", "image_url": {"url": data_uri(image)}},
                     {"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}):
            r = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=30, json={
                "model": path.name, "max_tokens": 4,
                "messages": [{"role": "user", "content": [part, {"type": "text", "text": "Describe this."}]}]})
            assert r.status_code == 400 and "--language-model-only" in r.json()["error"]["message"]
        r = httpx.post(f"{srv.base_url}/v1/chat/completions", timeout=60, json={
            "model": path.name, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Hello there"}]})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    finally:
        srv.stop()
