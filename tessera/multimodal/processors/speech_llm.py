"""Qwen3-ASR and GLM-ASR processors: one audio clip per item, one placeholder run per clip.

transformers' Qwen3ASRProcessor and GlmAsrProcessor take exactly one clip per text. A request with one clip and a
prompt goes through the HF processor whole (its placeholder expansion is the reference); otherwise each clip goes
through it on its own behind a bare placeholder, and the prompt's placeholders are expanded here to the same
counts. Either way a clip's features are the ones the HF processor makes of that clip alone.

- Qwen3-ASR: log-mel [num_mel_bins, frames] of the whole clip (any length; frames padded to a multiple of
  2 * n_window), `qwen3_asr_output_len(real frames)` tokens.
- GLM-ASR: the clip cut into the extractor's chunks (30 s) up to the processor's max_audio_len, each padded to the
  chunk: [num_windows, num_mel_bins, chunk frames], `glm_asr_output_len` tokens per window.
model_specific_data["input_features_mask"] marks the real frames. A processor_output dict holds the same fields
(Qwen3-ASR: a batch of clips, or one; GLM-ASR: one clip's windows).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tessera.messages.items import Modality
from tessera.multimodal.geometry import GLM_ASR_MERGE, SPEECH_MASK_KEY, glm_asr_output_len, qwen3_asr_output_len
from tessera.multimodal.processors.assemble import ItemFeatures
from tessera.multimodal.processors.assemble import as_tensor as _tensor
from tessera.multimodal.processors.base import BaseMultimodalProcessor, InputFormat, LoadedMultimodalData
from tessera.multimodal.processors.split import SplitByInputFormat, as_tensors
from tessera.multimodal.special_tokens import MultimodalSpecialTokens

__all__ = ["GlmAsrProcessor", "Qwen3ASRProcessor", "SpeechLLMProcessor"]


class SpeechLLMProcessor(SplitByInputFormat, BaseMultimodalProcessor):
    """What both families share; a subclass gives the per-clip shapes and token counts."""

    supported_modalities = frozenset({Modality.AUDIO})

    def __init__(self, hf_processor: Any, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        audio = hf_config.audio_config
        self.num_mel_bins = int(audio.num_mel_bins)
        extractor = hf_processor.feature_extractor
        if int(extractor.feature_size) != self.num_mel_bins:
            raise ValueError(f"feature extractor feature_size {extractor.feature_size} != audio_config.num_mel_bins "
                             f"{self.num_mel_bins}")
        self.embed_dim = int(hf_config.get_text_config().hidden_size)
        super().__init__(hf_processor, hf_config, *args, **kwargs)

    def build_special_tokens(self) -> MultimodalSpecialTokens:
        return MultimodalSpecialTokens(audio_token=self.hf_processor.audio_token,
                                       audio_token_id=getattr(self.hf_config, "audio_token_id", None))

    @property
    def chunk_seconds(self) -> float:
        """The window /v1/audio/transcriptions cuts long audio into: the feature extractor's chunk (30 s)."""
        return float(self.hf_processor.feature_extractor.chunk_length)

    def call_hf_processor(self, prompt: str | None, loaded: LoadedMultimodalData) -> Mapping[str, Any]:
        if prompt is not None and len(loaded.audios) == 1:
            return super().call_hf_processor(prompt, loaded)
        placeholder = self.hf_processor.audio_token
        clips = [super(SpeechLLMProcessor, self).call_hf_processor(
            placeholder, LoadedMultimodalData(InputFormat.RAW, audios=[audio])) for audio in loaded.audios]
        out: dict[str, Any] = {"clips": clips}
        if prompt is not None:  # unexpanded: the base expands the placeholders to the items' counts
            out["input_ids"] = torch.tensor([self.tokenize(prompt)])
        return out

    def split_fields(self, data: Mapping[str, Any], what: str, num_items: int | None) -> list[ItemFeatures]:
        if "clips" in data:
            return [f for clip in data["clips"] for f in self.split_fields(clip, what, 1)]
        for key in ("input_features", SPEECH_MASK_KEY):
            if data.get(key) is None:
                raise ValueError(f"{what} audio data needs {key!r}")
        features = _tensor(data["input_features"], "input_features")
        masks = _tensor(data[SPEECH_MASK_KEY], SPEECH_MASK_KEY)
        if not features.is_floating_point() or features.ndim not in (2, 3) or features.shape[-2] != self.num_mel_bins:
            raise ValueError(f"input_features has shape {tuple(features.shape)} ({features.dtype}); the audio encoder "
                             f"takes floating-point [.., {self.num_mel_bins}, frames]")
        features = features if features.ndim == 3 else features[None]
        masks = (masks if masks.ndim == 2 else masks[None]).to(torch.long)
        if tuple(masks.shape) != (features.shape[0], features.shape[2]):
            raise ValueError(f"{SPEECH_MASK_KEY} has shape {tuple(masks.shape)}; expected "
                             f"[{features.shape[0]}, {features.shape[2]}] (one row per input_features row)")
        if bool(((masks != 0) & (masks != 1)).any()):
            raise ValueError(f"{SPEECH_MASK_KEY} must hold only 0 and 1")
        return self.clip_items(features, masks)

    def clip_items(self, features: torch.Tensor, masks: torch.Tensor) -> list[ItemFeatures]:
        """The items of checked rows: features [rows, mel, frames], masks [rows, frames] long."""
        raise NotImplementedError

    def split_embeddings(self, data: Mapping[str, Any]) -> list[ItemFeatures]:
        """`feature`: one [num_tokens, hidden] projected encoder output, or a list of them (one per clip)."""
        if data.get("feature") is None:
            raise ValueError("precomputed_embedding audio data needs 'feature' (projected encoder output)")
        chunks = [c[0] if c.ndim == 3 and c.shape[0] == 1 else c for c in as_tensors(data["feature"], "feature")]
        for c in chunks:
            if c.ndim != 2 or c.shape[0] == 0 or c.shape[1] != self.embed_dim or not c.is_floating_point():
                raise ValueError(f"precomputed audio feature has shape {tuple(c.shape)} ({c.dtype}); the language "
                                 f"model takes floating-point [num_tokens, {self.embed_dim}]")
        return [ItemFeatures(Modality.AUDIO, c.shape[0], precomputed_embedding=c.clone()) for c in chunks]


def _item(num_tokens: int, feature: torch.Tensor, mask: torch.Tensor) -> ItemFeatures:
    if num_tokens < 1:
        raise ValueError(f"{SPEECH_MASK_KEY} marks no frame of a clip as real audio")
    return ItemFeatures(Modality.AUDIO, num_tokens, feature=feature.clone(),
                        model_specific_data={SPEECH_MASK_KEY: mask.clone()})


class Qwen3ASRProcessor(SpeechLLMProcessor):
    """Qwen3ASRForConditionalGeneration: each row is a clip, cut to its own chunks (a batch pads to its longest)."""

    def __init__(self, hf_processor: Any, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        self.n_window = int(hf_config.audio_config.n_window)
        super().__init__(hf_processor, hf_config, *args, **kwargs)

    def hf_kwargs(self, modality: Modality) -> dict[str, Any]:
        kwargs = super().hf_kwargs(modality)
        if modality is Modality.AUDIO:
            kwargs["n_window"] = self.n_window  # the processor's default must match the encoder's chunking
        return kwargs

    def clip_items(self, features: torch.Tensor, masks: torch.Tensor) -> list[ItemFeatures]:
        chunk = 2 * self.n_window
        if features.shape[-1] % chunk:
            raise ValueError(f"input_features has {features.shape[-1]} frames; Qwen3-ASR's encoder takes a multiple "
                             f"of 2 * n_window = {chunk}")
        out = []
        for feature, mask in zip(features, masks):
            valid = int(mask.sum())
            frames = -(-valid // chunk) * chunk  # padding past the clip's last chunk is masked out entirely
            out.append(_item(qwen3_asr_output_len(valid, self.n_window), feature[:, :frames], mask[:frames]))
        return out


class GlmAsrProcessor(SpeechLLMProcessor):
    """GlmAsrForConditionalGeneration: all rows are one clip's windows."""

    def __init__(self, hf_processor: Any, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        frames = int(hf_processor.feature_extractor.nb_max_frames)
        if frames % (2 * GLM_ASR_MERGE):
            raise ValueError(f"feature extractor pads windows to {frames} mel frames; GLM-ASR merges "
                             f"{GLM_ASR_MERGE} encoder frames (2 mel frames each), so it must be a multiple of "
                             f"{2 * GLM_ASR_MERGE}")
        super().__init__(hf_processor, hf_config, *args, **kwargs)

    def clip_items(self, features: torch.Tensor, masks: torch.Tensor) -> list[ItemFeatures]:
        tokens = sum(glm_asr_output_len(int(n)) for n in masks.sum(-1) if int(n) > 0)
        return [_item(tokens, features, masks)]
