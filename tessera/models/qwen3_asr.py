"""Qwen3-ASR (`Qwen3ASRForConditionalGeneration`): transformers' `Qwen3ASREncoder` + an MLP projector over our
Qwen3 language model (models/speech_llm.py).

The encoder cuts each clip's mel frames into chunks of 2 * n_window (1 s), runs three stride-2 convolutions on
every chunk, and attends within windows of n_window_infer frames (8 s in the released checkpoints), so it takes
any length: an item is one whole clip, [num_mel_bins, frames] with frames a multiple of the chunk. The encoder
packs the real frames of a batch itself; items of a step are padded to the longest (padding chunks are masked
out entirely, and a window's length does not depend on the batch once a clip holds a full chunk).
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.layers.attention import BaseAttentionBackend
from tessera.models.config import ModelConfig
from tessera.models.speech_llm import MlpProjector, SpeechLLM
from tessera.multimodal.geometry import qwen3_asr_output_len


class Qwen3ASRForConditionalGeneration(SpeechLLM):
    AUDIO_TOWER = "transformers.models.qwen3_asr.modeling_qwen3_asr:Qwen3ASREncoder"

    def __init__(self, config: ModelConfig, attn_backend: BaseAttentionBackend | None = None,
                 language_model_only: bool = False):
        # The original release (Qwen/Qwen3-ASR-1.7B) nests its sizes in `thinker_config`, which transformers'
        # Qwen3ASRConfig does not read: it would build default-sized towers that no weight fits.
        if getattr(config.hf_config, "thinker_config", None) is not None:
            raise ValueError("config.thinker_config: this is the original Qwen3-ASR checkpoint layout; serve the "
                             "transformers conversion (e.g. Qwen/Qwen3-ASR-1.7B-hf)")
        super().__init__(config, attn_backend, language_model_only)

    def build_projector(self, hf_config: Any) -> MlpProjector:
        audio = hf_config.audio_config
        if int(audio.output_dim) != self.config.hidden_size:
            raise ValueError(f"audio_config.output_dim ({audio.output_dim}) must equal the text model's hidden_size "
                             f"({self.config.hidden_size})")
        return MlpProjector(int(audio.d_model), int(audio.d_model), int(audio.output_dim),
                            str(audio.activation_function))

    def encode_audio(self, features: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
        n_window = int(self.config.hf_config.audio_config.n_window)
        frames = max(f.shape[-1] for f in features)
        batch = torch.zeros(len(features), self.num_mel_bins, frames)
        mask = torch.zeros(len(features), frames, dtype=torch.long)
        for b, (f, m) in enumerate(zip(features, masks)):
            if f.shape[-1] % (2 * n_window):
                raise ValueError(f"audio feature has {f.shape[-1]} frames; Qwen3-ASR's encoder takes a multiple of "
                                 f"2 * n_window = {2 * n_window}")
            batch[b, :, : f.shape[-1]] = f.reshape(self.num_mel_bins, -1)
            mask[b, : m.numel()] = m.reshape(-1)
        batch = self._weight_like(batch)
        hidden = self.audio_tower(batch, input_features_mask=mask.to(batch.device)).last_hidden_state
        embeds = self.multi_modal_projector(hidden)
        lengths = [qwen3_asr_output_len(int(m.sum()), n_window) for m in mask]
        return list(embeds.split(lengths))
