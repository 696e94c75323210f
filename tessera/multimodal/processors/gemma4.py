"""Gemma 4 processor: images and video frames at their own aspect ratio, within a soft-token budget.

The image processor resizes each image to the largest size of at most max_soft_tokens x k^2 patches whose sides
are multiples of k x patch_size (k = pooling_kernel_size), so an image has its own number of soft tokens
(num_soft_tokens_per_image); the video processor does the same per frame with its own (smaller) budget. Their
outputs are patch rows padded to the budget with position (-1, -1); an item keeps only its real rows
([patches, 3p^2] for an image, [frames, patches, 3p^2] for a video) and their positions
(model_specific_data["position_ids"], see models/gemma4.py).

The prompt holds `<|image|>` / `<|video|>` once per item. HF's Gemma4Processor replaces each by text and
tokenizes the whole prompt: an image by <boi> + <|image|> x n + <eoi>, a video by "mm:ss <boi><|video|> x n<eoi>"
per frame, joined by spaces (timestamps from the clip's frame indices and fps). This processor runs the two
halves as HF does (image / video processor, then the tokenizer over the prompt with each item's text in place),
also when the preprocessing cache spares the first half; given input_ids are expanded token-wise. A video's
frame times are kept in model_specific_data["timestamps"] for that.

Audio, for checkpoints with an audio tower (audio_config): the feature extractor's log-mel frames, the item
keeping its valid ones [frames, bins]; `<|audio|>` becomes <boa> + <|audio|> x n + <eoa>, n the valid frames
subsampled twice by 2 (HF's replace_audio_token). Without an audio tower audio is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from tessera.messages.items import Modality, MultimodalDataItem
from tessera.multimodal.media import VideoClip
from tessera.multimodal.processors.assemble import as_tensor as _tensor
from tessera.multimodal.processors.assemble import build_items
from tessera.multimodal.processors.base import (
    BaseMultimodalProcessor,
    InputFormat,
    ItemFeatures,
    LoadedMultimodalData,
)
from tessera.multimodal.processors.hf_compat import merge_processor_kwargs
from tessera.multimodal.processors.split import embedding_chunks
from tessera.multimodal.special_tokens import MultimodalSpecialTokens

__all__ = ["Gemma4Processor"]

POSITION_IDS, TIMESTAMPS = "position_ids", "timestamps"  # model_specific_data keys (POSITION_IDS: models/gemma4)
_KWARGS_CLASS = "transformers.models.gemma4.processing_gemma4:Gemma4ProcessorKwargs"


def _mmss(seconds: float) -> str:
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


class Gemma4Processor(BaseMultimodalProcessor):
    """Gemma4ForConditionalGeneration (images, video)."""

    supported_modalities: ClassVar[frozenset[Modality]] = frozenset({Modality.IMAGE, Modality.VIDEO, Modality.AUDIO})

    def __init__(self, hf_processor: Any, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        if getattr(hf_config, "audio_config", None) is None or getattr(hf_processor, "audio_token", None) is None:
            self.supported_modalities = frozenset({Modality.IMAGE, Modality.VIDEO})  # no audio tower: refused
        self.boi, self.eoi = hf_processor.boi_token, hf_processor.eoi_token
        self.boa, self.eoa = getattr(hf_processor, "boa_token", None), getattr(hf_processor, "eoa_token", None)
        self.pooling = int(hf_config.vision_config.pooling_kernel_size)
        self.embed_dim = int(hf_config.get_text_config().hidden_size)
        super().__init__(hf_processor, hf_config, *args, **kwargs)

    def build_special_tokens(self) -> MultimodalSpecialTokens:
        p = self.hf_processor
        audio = p.audio_token if Modality.AUDIO in self.supported_modalities else None
        return MultimodalSpecialTokens(image_token=p.image_token, video_token=p.video_token, audio_token=audio)

    # ------------------------------------------------------------ expansion

    def replacement(self, feature: ItemFeatures) -> str:
        """The text HF's Gemma4Processor puts in place of one item's placeholder."""
        token = self.special_tokens.tokens(feature.modality)[0]
        if feature.modality is Modality.IMAGE:
            return f"{self.boi}{token * feature.num_tokens}{self.eoi}"
        if feature.modality is Modality.AUDIO:
            return f"{self.boa}{token * feature.num_tokens}{self.eoa}"
        stamps = feature.model_specific_data[TIMESTAMPS].tolist()
        per_frame = feature.num_tokens // len(stamps)
        return " ".join(f"{_mmss(t)} {self.boi}{token * per_frame}{self.eoi}" for t in stamps)

    def expand_prompt(self, prompt: str, features: Sequence[ItemFeatures]) -> str:
        """`prompt` with each placeholder replaced by its item's text (items of a modality in prompt order)."""
        self.special_tokens.check_counts(prompt, {m: sum(1 for f in features if f.modality is m)
                                                  for m in self.supported_modalities})
        queues = {m: iter([f for f in features if f.modality is m]) for m in self.supported_modalities}
        tokens = {self.special_tokens.tokens(m)[0]: m for m in self.supported_modalities}
        out, i = [], 0
        while i < len(prompt):
            hit = next((t for t in tokens if prompt.startswith(t, i)), None)
            if hit is None:
                out.append(prompt[i])
                i += 1
            else:
                out.append(self.replacement(next(queues[tokens[hit]])))
                i += len(hit)
        return "".join(out)

    def _is_expanded(self, input_ids: list[int], features: Sequence[ItemFeatures]) -> bool:
        found = self.special_tokens.count_ids(input_ids)
        return all(found.get(m, 0) == sum(f.num_tokens for f in features if f.modality is m)
                   for m in self.supported_modalities)

    def expand_placeholders(self, input_ids: list[int], features: Sequence[ItemFeatures]) -> list[int]:
        """`input_ids` unchanged when already expanded, else each placeholder id replaced by its item's
        tokenized replacement text."""
        if self._is_expanded(input_ids, features):
            return list(input_ids)
        ids = {self.special_tokens.token_id(m): m for m in self.supported_modalities}
        queues = {m: iter([f for f in features if f.modality is m]) for m in self.supported_modalities}
        found = self.special_tokens.count_ids(input_ids)
        wanted = {m: sum(1 for f in features if f.modality is m) for m in self.supported_modalities}
        if any(found.get(m, 0) != n for m, n in wanted.items()):
            raise ValueError(f"input_ids have {dict((m.value, found.get(m, 0)) for m in wanted)} placeholders; "
                             f"expected one per item {dict((m.value, n) for m, n in wanted.items())} or "
                             "already-expanded media tokens")
        tokenizer = getattr(self.hf_processor, "tokenizer", self.hf_processor)
        out: list[int] = []
        for t in input_ids:
            if t in ids:
                out += list(tokenizer(self.replacement(next(queues[ids[t]])), add_special_tokens=False)["input_ids"])
            else:
                out.append(t)
        return out

    # ------------------------------------------------------------ the HF processor's halves

    def _kwargs(self, modality: Modality) -> dict[str, Any]:
        key = {Modality.IMAGE: "images_kwargs", Modality.VIDEO: "videos_kwargs", Modality.AUDIO: "audio_kwargs"}[modality]
        merged = merge_processor_kwargs(self.hf_processor, _KWARGS_CLASS, **{key: self.hf_kwargs(modality)})
        return {**merged[key], "return_tensors": "pt"}

    def video_call_kwargs(self, videos: Sequence[VideoClip]) -> dict[str, Any]:
        """Our loader sampled the frames; HF times them from each clip's indices and fps (None: HF's 24)."""
        return {"do_sample_frames": False, "return_metadata": True, "video_metadata": [
            {"fps": clip.fps or 24, "total_num_frames": clip.total_num_frames,
             "frames_indices": list(clip.sampled_indices)} for clip in videos]}

    def call_hf_processor(self, prompt: str | None, loaded: LoadedMultimodalData) -> Mapping[str, Any]:
        out: dict[str, Any] = {}
        if loaded.images:
            out.update(self.hf_processor.image_processor(loaded.images, **self._kwargs(Modality.IMAGE),
                                                         **self.image_call_kwargs()))
        if loaded.videos:
            out.update(self.hf_processor.video_processor(
                videos=[clip.frames for clip in loaded.videos],
                **{**self._kwargs(Modality.VIDEO), **self.video_call_kwargs(loaded.videos)}))
        if loaded.audios:
            out.update(self.hf_processor.feature_extractor(loaded.audios, **self._kwargs(Modality.AUDIO)))
        if prompt is not None:
            out["input_ids"] = torch.tensor([self.tokenize(self.expand_prompt(prompt, self.split_hf_output(
                out, loaded)))])
        return out

    def _process_raw(self, prompt: str | None, input_ids: list[int] | None, loaded: LoadedMultimodalData,
                     ) -> tuple[list[int], list[ItemFeatures], list[int]]:
        ids, features, hashes = super()._process_raw(prompt, input_ids, loaded)
        if prompt is not None and not self._is_expanded(ids, features):  # ids of the bare prompt (cache hit)
            ids = self.tokenize(self.expand_prompt(prompt, features))
        return ids, features, hashes

    def _build_items(self, input_ids: list[int], features: Sequence[ItemFeatures],
                     hashes: Sequence[int]) -> list[MultimodalDataItem]:
        return build_items(input_ids, features, hashes, self.special_tokens)

    # ------------------------------------------------------------ splitting

    def _rows(self, pixels: torch.Tensor, positions: torch.Tensor, tokens: int, what: str
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The real patch rows of one image / frame (tokens x k^2 of them, before the padding)."""
        n = tokens * self.pooling ** 2
        if pixels.ndim != 2 or positions.shape != (pixels.shape[0], 2) or n > pixels.shape[0] \
                or not pixels.is_floating_point() or bool((positions[:n] < 0).any()):
            raise ValueError(f"{what}: patch rows {tuple(pixels.shape)} with positions {tuple(positions.shape)} "
                             f"do not hold {tokens} soft tokens of {self.pooling ** 2} patches")
        return pixels[:n].clone(), positions[:n].clone()

    def split_fields(self, data: Mapping[str, Any], what: str) -> list[ItemFeatures]:
        out = []
        if data.get("pixel_values") is not None:
            pixels = _tensor(data["pixel_values"], "pixel_values")
            positions = _tensor(data.get("image_position_ids"), "image_position_ids")
            tokens = _tensor(data.get("num_soft_tokens_per_image"), "num_soft_tokens_per_image").reshape(-1)
            if pixels.ndim != 3 or len(tokens) != pixels.shape[0] or positions.shape[:2] != pixels.shape[:2]:
                raise ValueError(f"{what}: pixel_values {tuple(pixels.shape)}, image_position_ids "
                                 f"{tuple(positions.shape)} and num_soft_tokens_per_image {tokens.tolist()} disagree")
            for p, pos, n in zip(pixels, positions, tokens.tolist()):
                rows, where = self._rows(p, pos, int(n), what)
                out.append(ItemFeatures(Modality.IMAGE, int(n), feature=rows,
                                        model_specific_data={POSITION_IDS: where}))
        if data.get("pixel_values_videos") is not None:
            frames = _tensor(data["pixel_values_videos"], "pixel_values_videos")
            positions = _tensor(data.get("video_position_ids"), "video_position_ids")
            counts = _tensor(data.get("num_frames_per_video"), "num_frames_per_video").reshape(-1).tolist()
            metadata = data.get("video_metadata") or [None] * len(counts)
            if frames.ndim != 3 or sum(counts) != frames.shape[0] or positions.shape[:2] != frames.shape[:2]:
                raise ValueError(f"{what}: pixel_values_videos {tuple(frames.shape)}, video_position_ids "
                                 f"{tuple(positions.shape)} and num_frames_per_video {counts} disagree")
            start = 0
            for count, meta in zip(counts, metadata):
                valid = (positions[start] >= 0).all(-1).sum()
                per_frame = int(valid) // self.pooling ** 2
                rows = [self._rows(f, p, per_frame, what) for f, p in
                        zip(frames[start:start + count], positions[start:start + count])]
                stamps = list(getattr(meta, "timestamps", None) or [i / 24 for i in range(count)])
                out.append(ItemFeatures(Modality.VIDEO, per_frame * count, feature=torch.stack([r[0] for r in rows]),
                                        model_specific_data={POSITION_IDS: torch.stack([r[1] for r in rows]),
                                                             TIMESTAMPS: torch.tensor(stamps, dtype=torch.float64)}))
                start += count
        if data.get("input_features") is not None:
            mels = _tensor(data["input_features"], "input_features")
            if mels.ndim == 2:
                mels = mels[None]
            mask = data.get("input_features_mask")
            mask = torch.ones(mels.shape[:2], dtype=torch.bool) if mask is None else \
                _tensor(mask, "input_features_mask").reshape(mels.shape[:2]).bool()
            for mel, valid in zip(mels, mask):
                frames = int(valid.sum())
                if not mels.is_floating_point() or frames == 0 or not bool(valid[:frames].all()):
                    raise ValueError(f"{what}: input_features {tuple(mels.shape)} need floating-point log-mel frames "
                                     "and an input_features_mask that marks a non-empty prefix of each")
                tokens = -(-frames // 4)  # the tower's two stride-2 subsamplings: ceil(ceil(frames / 2) / 2)
                out.append(ItemFeatures(Modality.AUDIO, tokens, feature=mel[:frames].clone()))
        return out

    def _split_embeddings(self, modality: Modality, data: Mapping[str, Any]) -> list[ItemFeatures]:
        """Images' embedder outputs: `feature` a list of [tokens, hidden] (one per image), or all images' rows in
        one tensor with `num_soft_tokens_per_image` to split them."""
        if modality is not Modality.IMAGE:
            raise ValueError(f"precomputed_embedding {modality.value} data is not supported for Gemma 4 (images "
                             "only); send raw media or format='processor_output'")
        feature = data.get("feature")
        if isinstance(feature, (list, tuple)):
            tokens = [int(_tensor(f, "feature").shape[0]) for f in feature]
        elif data.get("num_soft_tokens_per_image") is not None:
            tokens = [int(n) for n in _tensor(data["num_soft_tokens_per_image"], "num_soft_tokens_per_image")
                      .reshape(-1).tolist()]
        else:
            tokens = [int(_tensor(feature, "feature").shape[0])] if feature is not None else []
        chunks = embedding_chunks(data, tokens, self.embed_dim, "num_soft_tokens_per_image",
                                  "the embedder's output rows")
        return [ItemFeatures(Modality.IMAGE, n, precomputed_embedding=c) for c, n in zip(chunks, tokens)]

    def split_hf_output(self, hf_output: Mapping[str, Any], loaded: LoadedMultimodalData) -> list[ItemFeatures]:
        features = self.split_fields(hf_output, "the HF processor's output")
        assert len(features) == len(loaded.images) + len(loaded.videos) + len(loaded.audios), "one item per medium"
        return features

    def split_preprocessed(self, modality: Modality, data: Mapping[str, Any],
                           input_format: InputFormat) -> list[ItemFeatures]:
        if input_format is InputFormat.PRECOMPUTED_EMBEDDING:
            return self._split_embeddings(modality, data)
        features = [f for f in self.split_fields(data, input_format.value) if f.modality is modality]
        if not features:
            raise ValueError(f"{input_format.value} {modality.value} data needs the HF processor's fields "
                             "(pixel_values, image_position_ids, num_soft_tokens_per_image; the video ones; "
                             "input_features and input_features_mask)")
        return features
