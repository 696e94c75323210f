"""Test helpers for Qwen2-VL parity: a tiny random config and prompt construction (HF positions and our
embeddings come from mrope_vlm_testing.py, shared with Qwen2.5-VL and Qwen3-VL).

(A uniquely named module rather than conftest.py, so `import` never picks up another directory's conftest.)
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.messages.items import Modality
from tests.models.mrope_vlm_testing import (  # noqa: F401  (shared by the M-RoPE families: re-exported)
    MRopePrompt,
    build_span_prompt,
    hf_positions,
    prompt_mm_embeds,
)

VOCAB, IMAGE_ID, VIDEO_ID, VSTART_ID, VEND_ID = 128, 120, 121, 122, 123
MERGE, PATCH_DIM = 2, 3 * 2 * 14 * 14  # channels * temporal_patch * patch * patch


def tiny_vl_config(num_kv_heads: int = 2, tie: bool = False):
    from transformers import Qwen2VLConfig

    text = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=num_kv_heads, rms_norm_eps=1e-6, max_position_embeddings=512,
        # A wider init than HF's 0.02 keeps top logits apart, so greedy decode is not decided by float noise.
        initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},  # head_dim 16
    )
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=MERGE, temporal_patch_size=2, in_channels=3, initializer_range=0.1)
    return Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_ID, video_token_id=VIDEO_ID,
                         vision_start_token_id=VSTART_ID, vision_end_token_id=VEND_ID, tie_word_embeddings=tie)


@dataclass
class Prompt(MRopePrompt):
    def hf_inputs(self) -> dict:
        """Every media key, None where the prompt has none (the Qwen2-VL tests' HF calls take them so)."""
        return dict(
            input_ids=self.input_ids[None], mm_token_type_ids=self.mm_token_type_ids[None],
            pixel_values=self.pixels(Modality.IMAGE), image_grid_thw=self.grids(Modality.IMAGE),
            pixel_values_videos=self.pixels(Modality.VIDEO), video_grid_thw=self.grids(Modality.VIDEO),
        )


def build_prompt(parts: list, seed: int = 0) -> Prompt:
    """mrope_vlm_testing.build_span_prompt's layout."""
    return build_span_prompt(parts, seed, Prompt, PATCH_DIM, (IMAGE_ID, VIDEO_ID, VSTART_ID, VEND_ID), MERGE)
