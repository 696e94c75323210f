"""Qwen2.5-VL: Qwen2-VL with another vision tower; the language model (Qwen2 + M-RoPE) is unchanged.

The tower is transformers' `Qwen2_5_VisionTransformerPretrainedModel` (window attention with full attention
in `fullatt_block_indexes`, RMSNorm, gated MLP, an RMSNorm + MLP patch merger whose width is
`out_hidden_size`). Like Qwen2-VL's it takes `(pixel rows, grid_thw)` and returns the merged embeddings,
back in patch order, as `pooler_output`; windows never cross a grid_thw row, so a step's items still share
one call. Checkpoint names are Qwen2-VL's (`model.visual.*`, `model.language_model.*`, `lm_head.*`).
Videos space their temporal M-RoPE positions by tokens_per_second x second_per_grid_ts: that is the
processor's job (tessera.multimodal.processors.qwen_vl), not the model's.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from tessera.models.qwen2_vl import Qwen2VLForConditionalGeneration


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    vision_tower: ClassVar[str] = (
        "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl:Qwen2_5_VisionTransformerPretrainedModel")

    def tower_embeddings(self, pixel_rows: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        assert self.visual is not None
        return self.visual(pixel_rows, grid_thw=grid_thw).pooler_output
