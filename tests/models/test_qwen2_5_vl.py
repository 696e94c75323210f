"""Qwen2.5-VL beyond the family parity suite (test_family_parity.py runs prefill, decode, batches, chunked
prefill, prefix hits, the towers and the language model alone for both qwen2_5_vl_testing.SPECS: images over
several vision attention windows, videos whose temporal positions are time-scaled): the time scaling itself, and
a complete checkpoint through the real processor.
"""

from __future__ import annotations

import pytest
from mrope_vlm_testing import check_real_processor_matches_hf
from qwen2_5_vl_testing import (
    TOKENS_PER_SECOND,
    Qwen2_5VLCase,
    build_prompt,
    load_hf_reference,
    make_tiny_qwen2_5_vl_checkpoint,
    our_positions,
)

from tests.models.family_parity import load_real_processor


def test_video_positions_are_time_scaled():
    """Temporal rows step by floor(i * tokens_per_second * second_per_grid_ts), as HF's get_rope_index (the
    parity itself is asserted for every prompt the suite feeds)."""
    prompt = build_prompt([2, ("video", (6, 2, 2), 1.25), 1])
    positions, delta = our_positions(prompt)
    (s, e), = prompt.items[0].offsets
    frame_starts = positions[0, s:e].unique() - positions[0, s]
    assert frame_starts.tolist() == [int(i * TOKENS_PER_SECOND * 1.25) for i in range(6)]
    # Text after the video resumes after its spatial extent, not its temporal one.
    assert positions[0, e] == positions[0, s] + 1 and delta == int(positions.max()) + 1 - len(prompt)


def test_real_processor_checkpoint_matches_hf(tmp_path):
    """make_tiny_qwen2_5_vl_checkpoint: AutoProcessor loads a Qwen2_5_VLProcessor, our processor (through the
    registry) gives HF's input_ids, pixels and time-scaled positions, and our model's logits and greedy tokens
    on our processor's output equal HF's on HF's processor output."""
    from transformers import Qwen2_5_VLProcessor

    from tessera.multimodal.processors.qwen_vl import QwenVLProcessor

    path = make_tiny_qwen2_5_vl_checkpoint(tmp_path / "ckpt", num_kv_heads=4, hidden=48, layers=3, heads=4,
                                           tie=True, vision_depth=3, fullatt_block_indexes=(0,), seed=3)
    case, processor, hf_processor = load_real_processor(path, load_hf_reference, Qwen2_5VLCase)
    assert isinstance(hf_processor, Qwen2_5_VLProcessor)
    assert isinstance(processor, QwenVLProcessor) and processor.tokens_per_second == TOKENS_PER_SECOND
    keys = ("input_ids", "mm_token_type_ids", "pixel_values", "image_grid_thw", "pixel_values_videos",
            "video_grid_thw", "second_per_grid_ts")
    _, ref = check_real_processor_matches_hf(case, processor, hf_processor, (84, 140), (56, 56), keys)
    assert ref["image_grid_thw"].tolist() == [[1, 6, 10]]  # non-square: 6x10 patches
    assert float(ref["second_per_grid_ts"][0]) == pytest.approx(2 / 1.5)  # 1.5 fps sampled
