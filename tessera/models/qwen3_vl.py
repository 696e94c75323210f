"""Qwen3-VL: our Qwen3 language model (qk-norm, no q/k/v bias) with interleaved M-RoPE and DeepStack, plus
transformers' `Qwen3VLVisionModel`.

DeepStack: the vision tower also returns, for each of `deepstack_visual_indexes`, a merged feature of that
intermediate block; transformers adds level i to the hidden states at the visual token rows after decoder
layer i (i < number of levels). Through the engine's seams this is one embedding per item that is
[num_tokens, hidden * (1 + levels)]: the main embedding followed by the levels. The worker's encoder
cache, held embeddings and per-chunk row slicing treat it like any embedding; `forward` splits it, merges
the main part into the token embeddings and adds level i to the same rows after layer i. A chunked
prefill therefore adds each chunk's own rows, exactly what the whole prompt would have added to them.
A caller's precomputed embedding must have the same layout (the processor checks the width).

Interleaved M-RoPE: transformers' Qwen3VLTextRotaryEmbedding always interleaves the t/h/w frequencies
(whatever `mrope_interleaved` says), so this family always does too. Positions come from the processor
(tessera.multimodal.processors.qwen3_vl), which treats each video frame as its own grid.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import ClassVar

import torch

from tessera.cache.kv_pool import TokenToKVPool
from tessera.layers.attention import BaseAttentionBackend
from tessera.layers.rotary import RotaryEmbedding
from tessera.models.config import ModelConfig
from tessera.models.mm_embed import EmbeddingCountError, merge_mm_embeddings
from tessera.models.qwen2_vl import Qwen2VLForConditionalGeneration
from tessera.models.qwen3 import QWEN3_OPTIONS, qwen3_decoder_options
from tessera.multimodal.processors.qwen3_vl import deepstack_levels
from tessera.layers.forward_batch import ForwardBatch

QWEN3_VL_MROPE_SECTION = (24, 20, 20)
LayerHook = Callable[[torch.Tensor], torch.Tensor]


def _add_rows(rows: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    return hidden.index_add_(0, rows, values.to(hidden.dtype))


class Qwen3VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    decoder_options = QWEN3_OPTIONS
    vision_tower: ClassVar[str] = "transformers.models.qwen3_vl.modeling_qwen3_vl:Qwen3VLVisionModel"

    def __init__(self, config: ModelConfig, attn_backend: BaseAttentionBackend | None = None,
                 language_model_only: bool = False):
        self.decoder_options = qwen3_decoder_options(config)  # read by CausalLM.__init__
        vision = config.hf_config.vision_config
        if int(vision.out_hidden_size) != config.hidden_size:  # before anything is built (a default-filled tower)
            raise ValueError(f"vision_config.out_hidden_size={vision.out_hidden_size} differs from the language "
                             f"model's hidden_size={config.hidden_size}")
        super().__init__(config, attn_backend, language_model_only)
        # A config without mrope_section gets transformers' Qwen3-VL default, not Qwen2-VL's.
        rope = dict(getattr(config.hf_config.get_text_config(), "rope_parameters", None) or {})
        section = [int(n) for n in rope.get("mrope_section", QWEN3_VL_MROPE_SECTION)]
        self.model.rotary_emb = RotaryEmbedding(self.rotary_dim(config), config.rope_theta, section,
                                                mrope_interleaved=True)
        self.num_deepstack_levels = deepstack_levels(vision)

    def rotary_dim(self, config: ModelConfig) -> int:
        """The head dims RoPE rotates (Qwen3.5: `partial_rotary_factor` of them)."""
        return config.head_dim

    @property
    def mm_embed_width(self) -> int:
        """Width of one item's embedding rows: the main embedding and every DeepStack level."""
        return self.config.hidden_size * (1 + self.num_deepstack_levels)

    def tower_embeddings(self, pixel_rows: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        assert self.visual is not None
        out = self.visual(pixel_rows, grid_thw=grid_thw)
        return torch.cat([out.pooler_output, *out.deepstack_features], dim=-1)

    def split_deepstack(self, fb: ForwardBatch) -> tuple[torch.Tensor | None, dict[int, LayerHook] | None]:
        """The step's media rows split into the main embeddings [n, hidden] and the DeepStack hooks: after
        layer i, level i is added at the same rows."""
        if fb.mm_embeds is None or fb.mm_embed_rows is None:
            return fb.mm_embeds, None
        if fb.mm_embeds.shape[-1] != self.mm_embed_width:
            raise EmbeddingCountError(
                f"media embeddings are {fb.mm_embeds.shape[-1]} wide; Qwen3-VL takes hidden_size x (1 + "
                f"{self.num_deepstack_levels} DeepStack levels) = {self.mm_embed_width}")
        main, *levels = fb.mm_embeds.split(self.config.hidden_size, dim=-1)
        return main, {i: partial(_add_rows, fb.mm_embed_rows, level) for i, level in enumerate(levels)}

    def forward(self, fb: ForwardBatch, pool: TokenToKVPool, input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        main, after_layer = self.split_deepstack(fb)
        if input_embeds is None:
            input_embeds = merge_mm_embeddings(self.model.embed_tokens(fb.input_ids), fb.mm_embed_rows, main)
        return self.compute_logits(self.model(input_embeds, fb.positions, fb, pool, after_layer=after_layer), fb)
