"""Speech LLMs (Qwen3-ASR, GLM-ASR): transformers' audio encoder + an MLP projector over our language model.

The language model is whatever `text_config.model_type` names (Qwen3 for Qwen3-ASR, Llama for GLM-ASR:
models/text_backbones.py). The encoder is transformers' own module, built empty by `build_transformers_tower` and
filled by our weight loader; a family says which encoder (`AUDIO_TOWER`), how its projector is shaped and how a
batch of items goes through the encoder (`encode_audio`). Checkpoint names are transformers' (`model.audio_tower.*`,
`model.multi_modal_projector.*`, `model.language_model.*`, `lm_head.*`) or its older saved layout.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from tessera.layers.attention import BaseAttentionBackend
from tessera.layers.decoder import DecoderOptions
from tessera.layers.linear import Linear
from tessera.messages.items import Modality, MultimodalDataItem
from tessera.models.base import Encoder
from tessera.models.causal_lm import CausalLM
from tessera.models.config import ModelConfig
from tessera.models.hf_towers import build_transformers_tower
from tessera.models.text_backbones import decoder_options_for, wrapper_weight_mapping
from tessera.models.weights import WeightMapping
from tessera.multimodal.geometry import SPEECH_MASK_KEY


class MlpProjector(nn.Module):
    """linear_2(act(linear_1(x))), named like transformers' `multi_modal_projector`."""

    def __init__(self, in_features: int, mid_features: int, out_features: int, act: str):
        from transformers.activations import ACT2FN

        super().__init__()
        self.linear_1 = Linear(in_features, mid_features, bias=True)
        self.act = ACT2FN[act]
        self.linear_2 = Linear(mid_features, out_features, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


class SpeechLLM(CausalLM):
    """Items carry `feature` (log-mel [.., num_mel_bins, frames]) with model_specific_data["input_features_mask"]
    (1 = real frame), or a `precomputed_embedding`. All feature items of a step go through the encoder in one
    call."""

    AUDIO_TOWER: ClassVar[str]  # transformers' encoder, "module:Class"

    def __init__(self, config: ModelConfig, attn_backend: BaseAttentionBackend | None = None,
                 language_model_only: bool = False):
        super().__init__(config, attn_backend, language_model_only)
        audio_cfg = config.hf_config.audio_config
        self.num_mel_bins = int(audio_cfg.num_mel_bins)
        self.audio_tower: nn.Module | None = None
        self.multi_modal_projector: MlpProjector | None = None
        if not language_model_only:
            self.audio_tower = build_transformers_tower(self.AUDIO_TOWER, audio_cfg)
            self.multi_modal_projector = self.build_projector(config.hf_config)

    @property
    def decoder_options(self) -> DecoderOptions:
        return decoder_options_for(self.config.hf_config.get_text_config())

    def build_projector(self, hf_config: Any) -> MlpProjector:
        raise NotImplementedError

    @classmethod
    def weight_mapping(cls, config: ModelConfig, language_model_only: bool = False) -> WeightMapping:
        return wrapper_weight_mapping(config.tie_word_embeddings, language_model_only,
                                      ("audio_tower.", "multi_modal_projector."))

    def encoders(self) -> dict[Modality, Encoder]:
        return {} if self.audio_tower is None else {Modality.AUDIO: self.get_audio_feature}

    # ---- audio encoding ---------------------------------------------------------------------------------

    def get_audio_feature(self, items: list[MultimodalDataItem]) -> list[torch.Tensor]:
        """One embedding [num_tokens, hidden] per audio item, in order; precomputed embeddings pass through."""
        checked = {i: self._checked(i, item) for i, item in enumerate(items) if item.precomputed_embedding is None}

        def encode(todo: list[int]) -> list[torch.Tensor]:
            if self.audio_tower is None or self.multi_modal_projector is None:
                raise RuntimeError("the model was loaded with language_model_only=True: it has no audio encoder")
            return self.encode_audio([checked[i][0] for i in todo], [checked[i][1] for i in todo])

        return self.encode_items(items, encode)

    def _checked(self, i: int, item: MultimodalDataItem) -> tuple[torch.Tensor, torch.Tensor]:
        """(feature, mask long) of item i: the mask has the feature's leading and frame dimensions."""
        if item.feature is None:
            raise ValueError(f"item {i}: neither feature nor precomputed_embedding is set")
        mask = item.model_specific_data.get(SPEECH_MASK_KEY)
        if mask is None:
            raise ValueError(f"item {i}: model_specific_data lacks {SPEECH_MASK_KEY!r}")
        feature, mask = item.feature, mask.to("cpu", torch.long)
        if feature.ndim < 2 or feature.shape[-2] != self.num_mel_bins or mask.shape != feature.shape[:-2] + \
                feature.shape[-1:]:
            raise ValueError(f"item {i}: audio feature {tuple(feature.shape)} with {SPEECH_MASK_KEY} "
                             f"{tuple(mask.shape)}; the encoder takes [.., {self.num_mel_bins}, frames] and a mask "
                             "[.., frames]")
        if int(mask.sum()) < 1:
            raise ValueError(f"item {i}: {SPEECH_MASK_KEY} marks no frame as real audio")
        return feature, mask

    def encode_audio(self, features: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per item its projected encoder output [num_tokens, hidden], all items in one encoder call."""
        raise NotImplementedError

    def _weight_like(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.like
        return x.to(device=weight.device, dtype=weight.dtype)
