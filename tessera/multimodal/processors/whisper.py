"""Whisper processor: one audio clip per request as log-mel features, and a decoder prompt without placeholders.

Whisper's decoder cross-attends to the clip's encoder output instead of reading audio tokens, so the prompt
(`<|startoftranscript|> <|en|> <|transcribe|> <|notimestamps|>`, see models/whisper_decoding.py) holds no
placeholder and the item owns no prompt tokens (its offsets are empty). The features are the checkpoint's
WhisperFeatureExtractor output: padded (or truncated) to its window, `n_samples` (30 s for OpenAI's
checkpoints), as HF's short-form generate takes them; /v1/audio/transcriptions cuts longer audio into windows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tessera.multimodal.hashing import hash_item
from tessera.messages.items import Modality, MultimodalDataItem, MultimodalInputs
from tessera.multimodal.processors.assemble import as_tensor
from tessera.multimodal.processors.base import (
    BaseMultimodalProcessor,
    InputFormat,
    ItemFeatures,
    LoadedMultimodalData,
    ProcessorOutput,
)
from tessera.multimodal.processors.whisper_features import WhisperFeatures
from tessera.multimodal.special_tokens import MultimodalSpecialTokens

__all__ = ["WhisperAudioProcessor"]


class WhisperAudioProcessor(WhisperFeatures, BaseMultimodalProcessor):
    """WhisperForConditionalGeneration."""

    def __init__(self, hf_processor: Any, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        self.check_extractor(hf_processor.feature_extractor, hf_config)  # Whisper's config is the encoder's too
        self.embed_dim = int(hf_config.d_model)
        super().__init__(hf_processor, hf_config, *args, **kwargs)

    def build_special_tokens(self) -> MultimodalSpecialTokens:
        return MultimodalSpecialTokens()  # no placeholders: the decoder cross-attends to the audio

    def tokenize(self, prompt: str) -> list[int]:
        """The decoder prompt as written: Whisper's tokenizer would otherwise prepend its own prefix tokens."""
        return list(self.hf_processor.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def call_hf_processor(self, prompt: str | None, loaded: LoadedMultimodalData) -> Mapping[str, Any]:
        out = self.hf_processor.feature_extractor(loaded.audios, sampling_rate=self.audio_sampling_rate,
                                                  return_tensors="pt")
        return {"input_features": out["input_features"]}

    def split_hf_output(self, hf_output: Mapping[str, Any], loaded: LoadedMultimodalData) -> list[ItemFeatures]:
        return [ItemFeatures(Modality.AUDIO, 0, feature=f.clone()) for f in hf_output["input_features"]]

    def split_preprocessed(self, modality: Modality, data: Mapping[str, Any],
                           input_format: InputFormat) -> list[ItemFeatures]:
        """processor_output: `input_features` [clips, mel, frames]; precomputed_embedding: `feature`, the encoder
        output [max_source_positions, d_model] (or a batch of them)."""
        if input_format is InputFormat.PROCESSOR_OUTPUT:
            if data.get("input_features") is None:
                raise ValueError("processor_output audio data needs 'input_features'")
            feats = as_tensor(data["input_features"], "input_features")
            feats = feats[None] if feats.ndim == 2 else feats
            expected = (self.num_mel_bins, self.num_frames)
            if feats.ndim != 3 or tuple(feats.shape[1:]) != expected or not feats.is_floating_point():
                raise ValueError(f"input_features has shape {tuple(feats.shape)} ({feats.dtype}); the encoder "
                                 f"takes floating-point [num_clips, {expected[0]}, {expected[1]}]")
            return [ItemFeatures(Modality.AUDIO, 0, feature=f.clone()) for f in feats]
        if data.get("feature") is None:
            raise ValueError("precomputed_embedding audio data needs 'feature' (the encoder output)")
        emb = as_tensor(data["feature"], "feature")
        emb = emb[None] if emb.ndim == 2 else emb
        expected = (self.num_frames // 2, self.embed_dim)
        if emb.ndim != 3 or tuple(emb.shape[1:]) != expected or not emb.is_floating_point():
            raise ValueError(f"precomputed audio feature has shape {tuple(emb.shape)}; the decoder cross-attends "
                             f"to floating-point [{expected[0]}, {expected[1]}]")
        return [ItemFeatures(Modality.AUDIO, 0, precomputed_embedding=e.clone()) for e in emb]

    def process_and_combine_mm_data(self, prompt: str | None, input_ids: list[int] | None,
                                    loaded: LoadedMultimodalData) -> ProcessorOutput:
        """The decoder prompt's ids (no placeholders to expand) and the request's one audio item."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt and input_ids")
        ids = self.tokenize(prompt) if prompt is not None else list(input_ids or [])
        if loaded.input_format is InputFormat.RAW:
            if len(loaded.audios) != 1:
                raise ValueError(f"audio: a Whisper request takes exactly one audio clip, got {len(loaded.audios)}")
            [key] = self._raw_hashes(loaded)
            features = self.preprocess_cache.get(key)
            if features is None:
                [features] = self.split_hf_output(self.call_hf_processor(None, loaded), loaded)
                self.preprocess_cache.put(key, features)
        else:
            found = [f for m, entries in loaded.preprocessed.items() for entry in entries
                     for f in self.split_preprocessed(m, entry, loaded.input_format)]
            if len(found) != 1:
                raise ValueError(f"audio: a Whisper request takes exactly one audio clip, got {len(found)}")
            [features] = found
            key = hash_item([features.feature, features.precomputed_embedding], {"format": loaded.input_format.value})
        item = MultimodalDataItem(Modality.AUDIO, key, offsets=[], feature=features.feature,
                                  precomputed_embedding=features.precomputed_embedding)
        return ProcessorOutput(input_ids=ids, mm_inputs=MultimodalInputs(items=[item]))
