"""Qwen3-VL served end to end: the OpenAI API on a tiny random checkpoint (DeepStack, interleaved M-RoPE,
timestamped video frame groups) answers exactly as HF generate: one image, two images of other shapes, the
first image again (a prefix-cache hit), and a video. Prefill chunks of 16 tokens split every image and video
across chunks, so the worker's per-chunk embedding rows (and their DeepStack levels) are exercised."""

from __future__ import annotations

import base64
import random

import pytest

from tessera.demo import scenes
from tessera.multimodal.media import MediaLimits, load_video
from tests.models.qwen3_vl_testing import make_tiny_qwen3_vl_checkpoint
from tests.multimodal.conftest import encode_mp4
from tests.server.server_process import ServerProcess
from tests.server.vlm_chat import check_model_info, data_uri, hf_chat_reply

MAX_TOKENS = 8
NUM_FRAMES = 4


@pytest.fixture(scope="module")
def qwen3_vl_server(tmp_path_factory):
    path = make_tiny_qwen3_vl_checkpoint(tmp_path_factory.mktemp("qwen3_vl"))
    srv = ServerProcess("--model-path", str(path), "--max-total-tokens", "4096", "--chunked-prefill-size", "16",
                        "--page-size", "4", "--mm-process-config", f'{{"video": {{"num_frames": {NUM_FRAMES}}}}}')
    yield srv, path
    srv.stop()


def _hf_reply(processor, model, content: list, images=None, clip=None) -> tuple[str, int]:
    return hf_chat_reply(processor, model, content, MAX_TOKENS, images, clip)


def test_chat_matches_hf(qwen3_vl_server) -> None:
    from openai import OpenAI
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    srv, path = qwen3_vl_server
    processor = AutoProcessor.from_pretrained(path)
    model = Qwen3VLForConditionalGeneration.from_pretrained(path).eval()
    client = OpenAI(base_url=f"{srv.base_url}/v1", api_key="none", timeout=60)

    def ask(parts: list, question: str):
        return client.chat.completions.create(model=path.name, temperature=0, max_tokens=MAX_TOKENS, messages=[
            {"role": "user", "content": [*parts, {"type": "text", "text": question}]}])

    rng = random.Random(7)
    images = [scenes.image_sample(rng).frames[0] for _ in range(2)]
    image_sets = [images[:1], [images[1].resize((96, 160)), images[0]], images[:1]]
    questions = ["What is in the image?", "What is in the image?", "Which shapes are there?"]
    answers = []
    for used, question in zip(image_sets, questions):
        reply = ask([{"type": "image_url", "image_url": {"url": data_uri(im)}} for im in used], question)
        content = [{"type": "image"} for _ in used] + [{"type": "text", "text": question}]
        assert (reply.choices[0].message.content, reply.usage.prompt_tokens) == _hf_reply(processor, model, content,
                                                                                          images=used)
        assert reply.usage.completion_tokens == MAX_TOKENS
        answers.append(reply)
    assert answers[0].choices[0].message.content != answers[1].choices[0].message.content
    # The repeated image came from the prefix cache (its whole span and more).
    assert answers[2].usage.prompt_tokens_details.cached_tokens >= 20

    frames = [f.resize((64, 64)) for f in scenes.video_sample(random.Random(3)).frames]
    mp4 = encode_mp4(frames, fps=5)
    clip = load_video(mp4, limits=MediaLimits(), num_frames=NUM_FRAMES)  # the frames the server samples
    video_uri = "data:video/mp4;base64," + base64.b64encode(mp4).decode()
    reply = ask([{"type": "video_url", "video_url": {"url": video_uri}}], "Which way is it moving?")
    content = [{"type": "video"}, {"type": "text", "text": "Which way is it moving?"}]
    assert len(clip.frames) == NUM_FRAMES  # two frame groups, each after its timestamp text
    assert (reply.choices[0].message.content, reply.usage.prompt_tokens) == _hf_reply(processor, model, content,
                                                                                      clip=clip)


def test_model_info(qwen3_vl_server) -> None:
    srv, _ = qwen3_vl_server
    check_model_info(srv.base_url, "Qwen3VLForConditionalGeneration", video=True)
