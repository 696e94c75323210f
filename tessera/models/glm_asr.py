"""GLM-ASR (`GlmAsrForConditionalGeneration`): transformers' `GlmAsrEncoder` (Whisper-style convolutions, rotary
attention layers) + an MLP projector over our Llama language model (models/speech_llm.py).

GlmAsrProcessor cuts a clip into windows of the feature extractor's chunk (30 s), each padded to the chunk, so an
item is [num_windows, num_mel_bins, frames] with a mask per window. Each window goes through the encoder on its own
(no attention mask: padding frames are attended, as in transformers); four encoder frames become one token, and a
window contributes the tokens of its real frames. The windows of all items of a step share one encoder call.
"""

from __future__ import annotations

from typing import Any

import torch

from tessera.models.speech_llm import MlpProjector, SpeechLLM
from tessera.multimodal.geometry import GLM_ASR_MERGE, glm_asr_output_len


class GlmAsrForConditionalGeneration(SpeechLLM):
    AUDIO_TOWER = "transformers.models.glmasr.modeling_glmasr:GlmAsrEncoder"

    def build_projector(self, hf_config: Any) -> MlpProjector:
        audio, text_hidden = hf_config.audio_config, self.config.hidden_size
        if int(audio.intermediate_size) != GLM_ASR_MERGE * int(audio.hidden_size):
            raise ValueError(f"audio_config.intermediate_size ({audio.intermediate_size}) must be {GLM_ASR_MERGE} x "
                             f"audio_config.hidden_size ({audio.hidden_size}): the projector reads "
                             f"{GLM_ASR_MERGE} encoder frames as one token")
        return MlpProjector(int(audio.intermediate_size), 2 * text_hidden, text_hidden,
                            str(hf_config.projector_hidden_act))

    def encode_audio(self, features: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
        windows = [f.reshape(-1, self.num_mel_bins, f.shape[-1]) for f in features]
        if len({w.shape[-1] for w in windows}) != 1:
            raise ValueError(f"GLM-ASR windows have {sorted({w.shape[-1] for w in windows})} frames; every window "
                             "is padded to the feature extractor's chunk")
        batch = self._weight_like(torch.cat(windows))
        hidden = self.audio_tower(batch).last_hidden_state
        merged = hidden.reshape(batch.shape[0], -1, GLM_ASR_MERGE * hidden.shape[-1])
        embeds = self.multi_modal_projector(merged)
        per_window = [glm_asr_output_len(int(n)) for m in masks for n in m.reshape(-1, m.shape[-1]).sum(-1)]
        rows = [embeds[w, :n] for w, n in enumerate(per_window)]
        counts = [w.shape[0] for w in windows]
        out, start = [], 0
        for c in counts:
            out.append(torch.cat(rows[start:start + c]))
            start += c
        return out
