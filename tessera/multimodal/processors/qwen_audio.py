"""Qwen2-Audio processor: audio clips as Whisper log-mel features, one `<|AUDIO|>` run per clip.

The HF `Qwen2AudioProcessor` (with a `WhisperFeatureExtractor`) pads every clip to the feature extractor's
chunk (`n_samples`, 30 s for Whisper) and truncates longer ones; an item owns its padded features
[num_mel_bins, nb_max_frames] and model_specific_data["feature_attention_mask"] ([1, frames], 1 = real frame).
It owns `audio_output_len(mask.sum())` placeholder tokens, the count the HF processor expands to.
Audio longer than one chunk is truncated, as in transformers; /v1/audio/transcriptions cuts long audio into
chunk-sized windows before it gets here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tessera.multimodal.geometry import FEATURE_MASK_KEY, audio_output_len
from tessera.messages.items import Modality
from tessera.multimodal.processors.assemble import ItemFeatures
from tessera.multimodal.processors.assemble import as_tensor as _tensor
from tessera.multimodal.processors.base import BaseMultimodalProcessor, LoadedMultimodalData
from tessera.multimodal.processors.whisper_features import WhisperFeatures
from tessera.multimodal.processors.split import SplitByInputFormat, as_tensors
from tessera.multimodal.special_tokens import MultimodalSpecialTokens

__all__ = ["QwenAudioProcessor"]

class QwenAudioProcessor(WhisperFeatures, SplitByInputFormat, BaseMultimodalProcessor):
    """Qwen2AudioForConditionalGeneration."""

    def __init__(self, hf_processor: Any, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        # What the encoder accepts, also checked on caller-supplied tensors here.
        self.check_extractor(hf_processor.feature_extractor, hf_config.audio_config)
        self.embed_dim = int(hf_config.get_text_config().hidden_size)
        super().__init__(hf_processor, hf_config, *args, **kwargs)

    def build_special_tokens(self) -> MultimodalSpecialTokens:
        return MultimodalSpecialTokens(
            audio_token=getattr(self.hf_processor, "audio_token", "<|AUDIO|>"),
            audio_token_id=getattr(self.hf_config, "audio_token_id", None),
        )

    # ------------------------------------------------------------ kwargs

    def hf_kwargs(self, modality: Modality) -> dict[str, Any]:
        kwargs = super().hf_kwargs(modality)
        if modality is Modality.AUDIO:
            # Qwen2AudioProcessor forces these; the text-free path below must match them.
            kwargs.update(padding="max_length", return_attention_mask=True)
        return kwargs

    def call_hf_processor(self, prompt: str | None, loaded: LoadedMultimodalData) -> Mapping[str, Any]:
        """With a prompt, the HF processor (its placeholder expansion is the reference). Without one (a
        preprocessing-cache miss among hits, or input_ids), the feature extractor alone: Qwen2AudioProcessor
        refuses audio without text, and its features are exactly the extractor's."""
        if prompt is not None:
            return super().call_hf_processor(prompt, loaded)
        assert not loaded.images and not loaded.videos, "only audio reaches this processor"
        out = self.hf_processor.feature_extractor(loaded.audios, return_tensors="pt",
                                                  **self.hf_kwargs(Modality.AUDIO))
        return {"input_features": out["input_features"], FEATURE_MASK_KEY: out["attention_mask"]}

    # ------------------------------------------------------------ splitting

    def split_fields(self, data: Mapping[str, Any], what: str, num_items: int | None) -> list[ItemFeatures]:
        for key in ("input_features", FEATURE_MASK_KEY):
            if data.get(key) is None:
                raise ValueError(f"{what} audio data needs {key!r}")
        features = _tensor(data["input_features"], "input_features")
        masks = _tensor(data[FEATURE_MASK_KEY], FEATURE_MASK_KEY)
        if features.ndim == 2:
            features = features[None]
        if masks.ndim == 1:
            masks = masks[None]
        expected = (self.num_mel_bins, self.num_frames)
        if features.ndim != 3 or tuple(features.shape[1:]) != expected or not features.is_floating_point():
            raise ValueError(f"input_features has shape {tuple(features.shape)} ({features.dtype}); the audio "
                             f"encoder takes floating-point [num_clips, {expected[0]}, {expected[1]}]")
        if masks.ndim != 2 or tuple(masks.shape) != (features.shape[0], self.num_frames):
            raise ValueError(f"{FEATURE_MASK_KEY} has shape {tuple(masks.shape)}; expected "
                             f"[{features.shape[0]}, {self.num_frames}] (one row per clip)")
        masks = masks.to(torch.long)
        if bool(((masks != 0) & (masks != 1)).any()):
            raise ValueError(f"{FEATURE_MASK_KEY} must hold only 0 and 1")
        out = []
        for feature, mask in zip(features, masks):
            num_valid = int(mask.sum())
            if num_valid < 1:
                raise ValueError(f"{FEATURE_MASK_KEY} marks no frame of a clip as real audio")
            out.append(ItemFeatures(Modality.AUDIO, audio_output_len(num_valid), feature=feature.clone(),
                                    model_specific_data={FEATURE_MASK_KEY: mask.view(1, -1).clone()}))
        return out

    def split_embeddings(self, data: Mapping[str, Any]) -> list[ItemFeatures]:
        """`feature`: one [num_tokens, hidden] encoder output, or a list of them (one per clip)."""
        feature = data.get("feature")
        if feature is None:
            raise ValueError("precomputed_embedding audio data needs 'feature' (projected encoder output)")
        chunks = as_tensors(feature, "feature")
        for i, c in enumerate(chunks):
            while c.ndim > 2 and c.shape[0] == 1:
                c = c[0]
            chunks[i] = c
            if c.ndim != 2 or c.shape[0] == 0 or c.shape[1] != self.embed_dim or not c.is_floating_point():
                raise ValueError(f"precomputed audio feature has shape {tuple(c.shape)} ({c.dtype}); the language "
                                 f"model takes floating-point [num_tokens, {self.embed_dim}]")
        return [ItemFeatures(Modality.AUDIO, c.shape[0], precomputed_embedding=c.clone()) for c in chunks]
