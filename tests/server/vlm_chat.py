"""Shared pieces of the per-family server tests: an OpenAI chat with images against `tessera serve`, and the
answer HF `generate` gives to the same conversation."""

from __future__ import annotations

import base64
import io

import torch


def data_uri(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def served_reply(base_url: str, model: str, images, question: str, max_tokens: int):
    """The openai client's chat completion for the images (data URIs) followed by `question`, greedy."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key="none", timeout=60)
    parts = [{"type": "image_url", "image_url": {"url": data_uri(im)}} for im in images]
    return client.chat.completions.create(
        model=model, temperature=0, max_tokens=max_tokens,
        messages=[{"role": "user", "content": [*parts, {"type": "text", "text": question}]}])


def hf_reply(path, hf_class, images, question: str, max_tokens: int) -> str:
    """HF generate's greedy answer for the same conversation, decoded without special tokens. `hf_class`: a
    transformers model class, or a function of the path that loads the model."""
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    model = hf_class.from_pretrained(path).eval() if hasattr(hf_class, "from_pretrained") else hf_class(path)
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": question}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    enc = processor(text=[text], images=images, return_tensors="pt")
    if enc["pixel_values"].dtype == torch.bfloat16:  # Llama-4's image processor: the model runs in float32
        enc["pixel_values"] = enc["pixel_values"].float()
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False)
    return processor.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def check_image_chats_match_hf(base_url: str, path, hf_class, image_sets, question: str, max_tokens: int) -> None:
    """Each image set's served answer equals HF generate's, runs max_tokens long, and the answers differ (they
    depend on the images)."""
    answers = []
    for used in image_sets:
        reply = served_reply(base_url, path.name, used, question, max_tokens)
        expected = hf_reply(path, hf_class, used, question, max_tokens)
        assert reply.choices[0].message.content == expected
        assert reply.usage.completion_tokens == max_tokens
        answers.append(expected)
    assert len(set(answers)) > 1, "the answer does not depend on the images"


def check_model_info(base_url: str, architecture: str, video: bool = False, audio: bool = False) -> None:
    """/model_info names the architecture and reports image input, and video and audio input as given."""
    import httpx

    info = httpx.get(f"{base_url}/model_info", timeout=10).json()
    assert info["architectures"] == [architecture]
    assert info["has_image_understanding"]
    assert (info["has_video_understanding"], info["has_audio_understanding"]) == (video, audio)


def hf_chat_reply(processor, model, content: list, max_tokens: int, images=None, clip=None,
                  videos_kwargs: dict | None = None, token_types: bool = True) -> tuple[str, int]:
    """HF generate's greedy answer to one user turn of `content` (with `images`, or `clip`: a VideoClip given with
    its metadata) and its prompt length. By default the processor is asked for its metadata and token types, which
    M-RoPE models' generate reads (Cosmos3-Edge's processor returns them only when asked); `videos_kwargs` replaces
    the first, `token_types=False` drops the second."""
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    kwargs = {}
    if clip is not None:
        metadata = [{"fps": clip.fps, "total_num_frames": clip.total_num_frames, "frames_indices": clip.sampled_indices}]
        kwargs = {"videos": [clip.frames],
                  "videos_kwargs": {**(videos_kwargs or {"return_metadata": True}), "video_metadata": metadata}}
    if token_types:
        kwargs["return_mm_token_type_ids"] = True
    enc = processor(text=[text], images=images, return_tensors="pt", **kwargs)
    with torch.inference_mode():
        out = model.generate(**enc, max_new_tokens=max_tokens, do_sample=False)
    prompt_len = enc["input_ids"].shape[1]
    return processor.tokenizer.decode(out[0, prompt_len:], skip_special_tokens=True), prompt_len


def check_images_and_video_match_hf(base_url: str, path, model, num_frames: int, max_tokens: int, fps: int,
                                    min_cached: int) -> None:
    """An M-RoPE family's server against HF generate (`model`, loaded from `path`): one image, two images of other
    shapes, the first image again (its span and more from the prefix cache: at least `min_cached` tokens), then
    an mp4 at `fps` of which the server samples `num_frames` frames. Answers and prompt lengths are HF's."""
    import random

    from openai import OpenAI
    from transformers import AutoProcessor

    from tessera.demo import scenes
    from tessera.multimodal.media import MediaLimits, load_video
    from tests.multimodal.conftest import encode_mp4

    processor = AutoProcessor.from_pretrained(path)
    client = OpenAI(base_url=f"{base_url}/v1", api_key="none", timeout=60)

    def ask(parts: list, question: str):
        return client.chat.completions.create(model=path.name, temperature=0, max_tokens=max_tokens, messages=[
            {"role": "user", "content": [*parts, {"type": "text", "text": question}]}])

    def hf(content: list, images=None, clip=None) -> tuple[str, int]:
        return hf_chat_reply(processor, model, content, max_tokens, images, clip,
                             videos_kwargs={"do_sample_frames": False}, token_types=False)

    rng = random.Random(7)
    images = [scenes.image_sample(rng).frames[0] for _ in range(2)]
    image_sets = [images[:1], [images[1].resize((96, 160)), images[0]], images[:1]]
    questions = ["What is in the image?", "What is in the image?", "Which shapes are there?"]
    answers = []
    for used, question in zip(image_sets, questions):
        reply = ask([{"type": "image_url", "image_url": {"url": data_uri(im)}} for im in used], question)
        content = [{"type": "image"} for _ in used] + [{"type": "text", "text": question}]
        assert (reply.choices[0].message.content, reply.usage.prompt_tokens) == hf(content, images=used)
        assert reply.usage.completion_tokens == max_tokens
        answers.append(reply)
    assert answers[0].choices[0].message.content != answers[1].choices[0].message.content
    assert answers[2].usage.prompt_tokens_details.cached_tokens >= min_cached

    frames = [f.resize((64, 64)) for f in scenes.video_sample(random.Random(3)).frames]
    mp4 = encode_mp4(frames, fps=fps)
    clip = load_video(mp4, limits=MediaLimits(), num_frames=num_frames)  # the frames the server samples
    assert len(clip.frames) == num_frames
    video_uri = "data:video/mp4;base64," + base64.b64encode(mp4).decode()
    reply = ask([{"type": "video_url", "video_url": {"url": video_uri}}], "Which way is it moving?")
    content = [{"type": "video"}, {"type": "text", "text": "Which way is it moving?"}]
    assert (reply.choices[0].message.content, reply.usage.prompt_tokens) == hf(content, clip=clip)
