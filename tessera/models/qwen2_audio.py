"""Qwen2-Audio: our Qwen2 language model (plain 1-D RoPE) over the paged KV cache + transformers' audio encoder.

The encoder is transformers' `Qwen2AudioEncoder` (Whisper-style: two convolutions, transformer layers, a
2x average pool), built without random init; our weight loader fills it and the projector. The encoder takes
mel features padded to exactly 2 * max_source_positions frames; each item's `feature_attention_mask` says
how many frames are real. As in transformers, padded frames are masked out as attention keys, and an item's
embedding is the first `audio_output_len(valid frames)` rows of the projected encoder output. All audio items
of a step go through the encoder in ONE batched call.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tessera.layers.attention import BaseAttentionBackend
from tessera.layers.decoder import STACKED_PARAMS
from tessera.layers.linear import Linear
from tessera.models.base import Encoder
from tessera.models.config import ModelConfig
from tessera.models.hf_towers import build_transformers_tower
from tessera.models.qwen2 import Qwen2ForCausalLM
from tessera.models.weights import WeightMapping
from tessera.messages.items import Modality, MultimodalDataItem
from tessera.multimodal.geometry import FEATURE_MASK_KEY, audio_output_len

AUDIO_TOWER = "transformers.models.qwen2_audio.modeling_qwen2_audio:Qwen2AudioEncoder"


class Qwen2AudioMultiModalProjector(nn.Module):
    """Encoder width -> language-model width; named `linear` like transformers' projector."""

    def __init__(self, audio_dim: int, text_dim: int):
        super().__init__()
        self.linear = Linear(audio_dim, text_dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Qwen2AudioForConditionalGeneration(Qwen2ForCausalLM):
    """transformers' Qwen2-Audio never ties lm_head to the embeddings (it declares no tied weights), so neither
    do we, whatever the config says: the checkpoint always carries lm_head."""

    def __init__(self, config: ModelConfig, attn_backend: BaseAttentionBackend | None = None,
                 language_model_only: bool = False):
        super().__init__(dataclasses.replace(config, tie_word_embeddings=False), attn_backend, language_model_only)
        audio_cfg = config.hf_config.audio_config
        # The encoder's position table fixes its input length: conv1 keeps it, conv2 halves it.
        self.num_input_frames: int = 2 * int(audio_cfg.max_source_positions)
        self.num_mel_bins: int = int(audio_cfg.num_mel_bins)
        self.audio_tower: nn.Module | None = None
        self.multi_modal_projector: Qwen2AudioMultiModalProjector | None = None
        if not language_model_only:
            self.audio_tower = build_transformers_tower(AUDIO_TOWER, audio_cfg)
            self.multi_modal_projector = Qwen2AudioMultiModalProjector(int(audio_cfg.d_model), config.hidden_size)

    @classmethod
    def weight_mapping(cls, config: ModelConfig, language_model_only: bool = False) -> WeightMapping:
        """Checkpoint names as transformers saves them (`language_model.model.*`, `language_model.lm_head.*`,
        `audio_tower.*`, `multi_modal_projector.*`) and its in-memory 5.x names (`model.language_model.*`,
        `model.audio_tower.*`, `model.multi_modal_projector.*`, `lm_head.*`). More specific prefixes first."""
        tower = None if language_model_only else "audio_tower."
        projector = None if language_model_only else "multi_modal_projector."
        return WeightMapping(
            prefix_rules=(
                ("language_model.lm_head.", "lm_head."),
                ("language_model.model.model.", "model."),  # as transformers < 5.23 saved it
                ("language_model.model.", "model."),
                ("model.language_model.", "model."),
                ("model.audio_tower.", tower),
                ("audio_tower.", tower),
                ("model.multi_modal_projector.", projector),
                ("multi_modal_projector.", projector),
                ("lm_head.", "lm_head."),
            ),
            stacked=STACKED_PARAMS,
            stacked_prefix="model.",  # the encoder keeps transformers' separate q/k/v projections
        )

    def encoders(self) -> dict[Modality, Encoder]:
        return {} if self.audio_tower is None else {Modality.AUDIO: self.get_audio_feature}

    # ---- audio encoding ---------------------------------------------------------------------------------

    def get_audio_feature(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        """One embedding [num_tokens, hidden] per audio item, in order; all feature items in one encoder call.

        Each item carries `feature` (log-mel [num_mel_bins, num_input_frames], padded like the HF processor
        pads) and model_specific_data["feature_attention_mask"] ([1, frames] or [frames], 1 = real frame), or
        a `precomputed_embedding` (returned as is, cast to the model's dtype/device).
        num_tokens = audio_output_len(mask.sum()).
        """
        checked = {i: self._checked_feature(i, item) for i, item in enumerate(items)
                   if item.precomputed_embedding is None}

        def encode(todo: list[int]) -> list[torch.Tensor]:
            embeds = self._encode(torch.stack([checked[i][0] for i in todo]),
                                  torch.stack([checked[i][1] for i in todo]))
            return list(embeds)

        return self.encode_items(items, encode)

    def _checked_feature(self, i: int, item: MultimodalDataItem) -> tuple[torch.Tensor, torch.Tensor]:
        """(feature [mel, frames], mask [frames] long) of item i, or ValueError naming what is wrong."""
        if item.feature is None:
            raise ValueError(f"item {i}: neither feature nor precomputed_embedding is set")
        if FEATURE_MASK_KEY not in item.model_specific_data:
            raise ValueError(f"item {i}: model_specific_data lacks {FEATURE_MASK_KEY!r}")
        feature = item.feature
        expected = (self.num_mel_bins, self.num_input_frames)
        if tuple(feature.shape) != expected:
            raise ValueError(f"item {i}: audio feature has shape {tuple(feature.shape)}, the encoder takes {expected}")
        mask = item.model_specific_data[FEATURE_MASK_KEY].reshape(-1).to("cpu", torch.long)
        if mask.shape[0] != self.num_input_frames:
            raise ValueError(f"item {i}: {FEATURE_MASK_KEY} has {mask.shape[0]} frames, the feature has "
                             f"{self.num_input_frames}")
        if int(mask.sum()) < 1:
            raise ValueError(f"item {i}: {FEATURE_MASK_KEY} marks no frame as real audio")
        return feature, mask

    def _encode(self, features: torch.Tensor, masks: torch.Tensor) -> list[torch.Tensor]:
        """features [B, mel, frames], masks [B, frames] -> per item [audio_output_len(valid), hidden]."""
        from transformers.masking_utils import create_bidirectional_mask

        if self.audio_tower is None or self.multi_modal_projector is None:
            raise RuntimeError("the model was loaded with language_model_only=True: it has no audio encoder")
        weight = self.model.embed_tokens.like
        num_valid = masks.sum(-1)
        # transformers masks keys past each item's conv1 output length (its frames, conv1 keeps the length,
        # then the stride-2 conv2): the same 2-D mask, expanded by transformers' own helper, keeps the
        # SDPA/eager mask format identical to the reference.
        conv_lens = (num_valid - 1) // 2 + 1
        max_len = (self.num_input_frames - 2) // 2 + 1
        mask_2d = (torch.arange(max_len)[None, :] < conv_lens[:, None]).to(torch.long)
        dummy = torch.zeros(features.shape[0], max_len, 1, dtype=weight.dtype, device=weight.device)
        attn_mask = create_bidirectional_mask(
            config=self.audio_tower.config, inputs_embeds=dummy, attention_mask=mask_2d.to(weight.device)
        )
        # The tower is built in the model's dtype (load_model's default-dtype context).
        hidden = self.audio_tower(features.to(device=weight.device, dtype=weight.dtype),
                                  attention_mask=attn_mask).last_hidden_state
        embeds = self.multi_modal_projector(hidden).to(weight.dtype)
        return [embeds[b, : audio_output_len(int(n))] for b, n in enumerate(num_valid.tolist())]
