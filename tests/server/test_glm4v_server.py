"""GLM-4.1V served end to end: the OpenAI API on a tiny random checkpoint (GLM-4's sandwich norms and partial
pair-wise rotary, M-RoPE, a video as timestamped <|image|> frames) answers exactly as HF generate: one image, two
images of other shapes, the first image again (a prefix-cache hit), and a video. Prefill chunks of 16 tokens
split every image and video across chunks."""

from __future__ import annotations

import base64
import random

import pytest
import torch

from tessera.demo import scenes
from tessera.multimodal.media import MediaLimits, load_video
from tests.models.glm4v_testing import make_tiny_glm4v_checkpoint
from tests.multimodal.conftest import encode_mp4
from tests.server.server_process import ServerProcess
from tests.server.vlm_chat import check_model_info, data_uri

MAX_TOKENS = 8
NUM_FRAMES = 4


@pytest.fixture(scope="module")
def glm4v_server(tmp_path_factory):
    path = make_tiny_glm4v_checkpoint(tmp_path_factory.mktemp("glm4v"))
    srv = ServerProcess("--model-path", str(path), "--max-total-tokens", "4096", "--chunked-prefill-size", "16",
                        "--page-size", "4", "--mm-process-config", f'{{"video": {{"num_frames": {NUM_FRAMES}}}}}')
    yield srv, path
    srv.stop()


def _hf_reply(processor, model, content: list, images=None, clip=None) -> tuple[str, int]:
    """HF generate's answer and its prompt length."""
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    kwargs = {}
    if clip is not None:
        kwargs = {"videos": [clip.frames], "videos_kwargs": {"do_sample_frames": False, "video_metadata": [
            {"fps": clip.fps, "total_num_frames": clip.total_num_frames, "frames_indices": clip.sampled_indices}]}}
    enc = processor(text=[text], images=images, return_tensors="pt", **kwargs)
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False)
    prompt_len = enc["input_ids"].shape[1]
    return processor.tokenizer.decode(out[0, prompt_len:], skip_special_tokens=True), prompt_len


def test_chat_matches_hf(glm4v_server) -> None:
    from openai import OpenAI
    from transformers import AutoProcessor

    from tests.models.glm4v_testing import load_hf_reference

    srv, path = glm4v_server
    processor = AutoProcessor.from_pretrained(path)
    model = load_hf_reference(path)
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
    assert answers[2].usage.prompt_tokens_details.cached_tokens >= 16

    frames = [f.resize((64, 64)) for f in scenes.video_sample(random.Random(3)).frames]
    mp4 = encode_mp4(frames, fps=2)
    clip = load_video(mp4, limits=MediaLimits(), num_frames=NUM_FRAMES)  # the frames the server samples
    video_uri = "data:video/mp4;base64," + base64.b64encode(mp4).decode()
    reply = ask([{"type": "video_url", "video_url": {"url": video_uri}}], "Which way is it moving?")
    content = [{"type": "video"}, {"type": "text", "text": "Which way is it moving?"}]
    assert len(clip.frames) == NUM_FRAMES  # two frames of two, each followed by its timestamp
    assert (reply.choices[0].message.content, reply.usage.prompt_tokens) == _hf_reply(processor, model, content,
                                                                                      clip=clip)


def test_model_info(glm4v_server) -> None:
    srv, _ = glm4v_server
    check_model_info(srv.base_url, "Glm4vForConditionalGeneration", video=True)
