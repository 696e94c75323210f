"""What audio processors over a WhisperFeatureExtractor share (Qwen2-Audio's and Whisper's).

The extractor pads (or truncates) every clip to its window, `n_samples`; the encoder takes exactly
2 * max_source_positions mel frames of num_mel_bins, checked here once at startup, since a mismatch found in the
scheduler process would fail a whole batch. The extractor settings that shape the features are hashed with the
content.
"""

from __future__ import annotations

from typing import Any, ClassVar

from tessera.messages.items import Modality

EXTRACTOR_FIELDS = ("feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft", "n_samples",
                    "nb_max_frames", "padding_value", "dither")


class WhisperFeatures:
    """Mixin for a BaseMultimodalProcessor whose hf_processor has a WhisperFeatureExtractor."""

    supported_modalities: ClassVar[frozenset[Modality]] = frozenset({Modality.AUDIO})
    hf_processor: Any
    num_mel_bins: int
    num_frames: int

    def check_extractor(self, extractor: Any, audio_config: Any) -> None:
        """Sets num_mel_bins / num_frames from the encoder's config; ValueError when the extractor disagrees."""
        self.num_mel_bins = int(audio_config.num_mel_bins)
        self.num_frames = 2 * int(audio_config.max_source_positions)
        if int(extractor.feature_size) != self.num_mel_bins:
            raise ValueError(f"feature extractor feature_size {extractor.feature_size} != num_mel_bins "
                             f"{self.num_mel_bins}")
        if int(extractor.nb_max_frames) != self.num_frames:
            raise ValueError(f"feature extractor pads to {extractor.nb_max_frames} frames; the audio encoder takes "
                             f"2 * max_source_positions = {self.num_frames}")

    @property
    def chunk_seconds(self) -> float:
        """The longest clip one item holds (longer ones are truncated): the extractor's padded length."""
        extractor = self.hf_processor.feature_extractor
        return float(extractor.n_samples) / float(extractor.sampling_rate)

    def feature_kwargs(self, modality: Modality) -> dict[str, Any]:
        kwargs = super().feature_kwargs(modality)  # type: ignore[misc]
        extractor = self.hf_processor.feature_extractor
        for name in EXTRACTOR_FIELDS:
            kwargs.setdefault(name, getattr(extractor, name, None))
        return kwargs
