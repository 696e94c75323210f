"""Fixtures: tiny random Qwen2-VL checkpoints with the demo tokenizer and processor."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tessera.demo import scenes
from tessera.demo.build_vl import build_skeleton


def make_tiny_checkpoint(path: Path, *, num_kv_heads: int, hidden: int = 64, layers: int = 2, heads: int = 4,
                         seed: int = 0) -> Path:
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    base = build_skeleton(path)  # tokenizer, chat template, processor files + the demo config's token ids
    head_dim = hidden // heads
    section = [head_dim // 4 - head_dim // 8, head_dim // 8 + head_dim // 16, head_dim // 2]
    section[2] = head_dim // 2 - section[0] - section[1]
    text = base.text_config.to_dict()
    text.pop("layer_types", None)
    text.update(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=num_kv_heads,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section})
    vision = base.vision_config.to_dict()
    vision.update(depth=2, embed_dim=32, num_heads=2, hidden_size=hidden)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                        image_token_id=base.image_token_id, video_token_id=base.video_token_id,
                        vision_start_token_id=base.vision_start_token_id,
                        vision_end_token_id=base.vision_end_token_id)
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(cfg)
    with torch.no_grad():  # random init is tiny; larger weights make greedy choices less degenerate
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_gqa(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-gqa"), num_kv_heads=2)


@pytest.fixture(scope="session")
def tiny_mha(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-mha"), num_kv_heads=4, hidden=48, layers=3, heads=4,
                                seed=1)


@pytest.fixture(scope="session")
def scene_images():
    rng = random.Random(42)
    return [scenes.image_sample(rng).frames[0] for _ in range(4)]


@pytest.fixture(scope="session")
def scene_video():
    return list(scenes.video_sample(random.Random(9)).frames)
