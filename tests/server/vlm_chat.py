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
