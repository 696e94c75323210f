"""Qwen3-VL beyond the family parity suite (test_family_parity.py runs prefill, decode, batches, chunked
prefill, prefix hits, the towers and the language model alone for both qwen3_vl_testing.SPECS, with videos laid
out in per-frame groups and DeepStack levels on every media row, and the checks in qwen3_vl_testing.FIXTURE):
the interleaved M-RoPE layout, and a complete checkpoint through the real processor.
"""

from __future__ import annotations

import torch
from mrope_vlm_testing import check_real_processor_matches_hf
from qwen3_vl_testing import Qwen3VLCase, load_hf_reference, make_tiny_qwen3_vl_checkpoint

from tessera.layers.rotary import RotaryEmbedding
from tests.models.family_parity import load_real_processor


def test_interleaved_mrope_matches_hf_rotary():
    """Our interleaved frequency-to-row map gives transformers' Qwen3VLTextRotaryEmbedding cos/sin (the
    real 128-dim [24, 20, 20] layout and a tiny one); the consecutive (Qwen2-VL) layout does not."""
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    positions = torch.randint(0, 500, (3, 17), generator=torch.Generator().manual_seed(0))
    for head_dim, section in ((128, [24, 20, 20]), (16, [2, 3, 3]), (20, [4, 3, 3])):
        cfg = Qwen3VLTextConfig(head_dim=head_dim, hidden_size=64, num_attention_heads=4, rope_parameters={
            "rope_type": "default", "rope_theta": 5e5, "mrope_section": section, "mrope_interleaved": True})
        ref_cos, ref_sin = Qwen3VLTextRotaryEmbedding(cfg)(torch.zeros(1, dtype=torch.float32), positions[:, None])
        for interleaved in (True, False):
            cos, sin = RotaryEmbedding(head_dim, 5e5, section, mrope_interleaved=interleaved).get_cos_sin(
                positions, torch.float32)
            same = torch.equal(torch.cat([cos, cos], -1), ref_cos[0]) and torch.equal(torch.cat([sin, sin], -1),
                                                                                         ref_sin[0])
            assert same == interleaved, (head_dim, interleaved)


def test_real_processor_checkpoint_matches_hf(tmp_path):
    """make_tiny_qwen3_vl_checkpoint: AutoProcessor loads a Qwen3VLProcessor; our processor (through the
    registry) gives HF's input_ids (timestamped frame groups), pixels and positions; our model's logits and
    greedy tokens on our processor's output equal HF's on HF's processor output."""
    from transformers import Qwen3VLProcessor

    from tessera.multimodal.processors.qwen3_vl import Qwen3VLProcessor as OurProcessor

    path = make_tiny_qwen3_vl_checkpoint(tmp_path / "ckpt")
    case, processor, hf_processor = load_real_processor(path, load_hf_reference, Qwen3VLCase)
    assert isinstance(hf_processor, Qwen3VLProcessor) and isinstance(processor, OurProcessor)
    keys = ("input_ids", "mm_token_type_ids", "pixel_values", "image_grid_thw", "pixel_values_videos",
            "video_grid_thw")
    out, ref = check_real_processor_matches_hf(case, processor, hf_processor, (96, 160), (64, 64), keys)
    assert "<0.3 seconds>" in hf_processor.tokenizer.decode(out.input_ids)  # frames 0 and 2 at 3 fps
    assert ref["image_grid_thw"].tolist() == [[1, 6, 10]] and ref["video_grid_thw"][0, 0] == 2  # 6x10 patches
    assert len(out.mm_inputs.items[1].offsets) == 2  # one run per frame group


def test_moe_config_without_its_vision_config_is_refused_before_weights(tmp_path):
    """transformers fills a missing vision_config with the flagship's (out_hidden_size 3584): refused by name, before
    any weight is read (the directory has none)."""
    import json

    import pytest
    from qwen3_vl_moe_testing import SPECS
    from qwen3_vl_testing import tiny_qwen3_vl_config

    from tessera.models.registry import load_model

    cfg = tiny_qwen3_vl_config(SPECS["moe"]).to_dict()
    del cfg["vision_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="lacks vision_config"):
        load_model(tmp_path, torch.float32)
