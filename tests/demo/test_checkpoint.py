"""The shipped demo-vl checkpoint: standard HF layout, loads offline, answers fixed scenes."""

from __future__ import annotations

import random

import pytest
import torch

from tessera.config import ASSETS_DIR
from tessera.demo import scenes

DEMO = ASSETS_DIR / "demo-vl"


def test_checkpoint_files_and_size() -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "preprocessor_config.json", "video_preprocessor_config.json", "chat_template.jinja",
                 "generation_config.json"):
        assert (DEMO / name).exists(), name
    assert (DEMO / "model.safetensors").stat().st_size <= 30 * 2**20


@pytest.fixture(scope="module")
def hf_demo():
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(DEMO)
    model = AutoModelForImageTextToText.from_pretrained(DEMO).eval()
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    return model, processor


@torch.no_grad()
def _answer(model, processor, sample: scenes.Sample) -> str:
    content = [{"type": sample.kind}, {"type": "text", "text": sample.question}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)
    media = {"images": [sample.frames[0]]} if sample.kind == "image" else {"videos": [list(sample.frames)]}
    enc = processor(text=[text], return_tensors="pt", **media)
    out = model.generate(**enc, max_new_tokens=24, do_sample=False)
    return processor.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)[0].strip()


def test_answers_fixed_scenes(hf_demo) -> None:
    """Regression guard on the questions the shipped model answers reliably (counting, and the color
    of the only shape in a scene); the per-question accuracy of every type is in the README."""
    model, processor = hf_demo
    rng = random.Random(123)
    samples = [scenes.image_sample(rng, "count") for _ in range(8)]
    samples += [scenes.image_sample(rng, "color", max_shapes=1) for _ in range(8)]
    answers = [_answer(model, processor, s) for s in samples]
    correct = sum(a == s.answer for a, s in zip(answers, samples))
    assert correct >= 14, list(zip(answers, [s.answer for s in samples]))
    # Answers are always well-formed words of the grammar, never free text.
    vocabulary = set(scenes.COUNT_WORDS) | set(scenes.COLORS)
    assert all(a in vocabulary for a in answers), answers
