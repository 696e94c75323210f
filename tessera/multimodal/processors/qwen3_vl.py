"""Qwen3-VL processor: Qwen2-VL's images, videos as timestamped frame groups, per-frame M-RoPE positions.

transformers' Qwen3VLProcessor expands a video's one `<|video_pad|>` into, per temporal grid step (a group
of temporal_patch_size frames), the text `<{t:.1f} seconds>` followed by `<|vision_start|>`, that frame
group's h*w/merge**2 pads and `<|vision_end|>`; t is the mean time of the group's first and last frame
(source index / fps; fps 24 when unknown, as HF). A video item therefore owns one placeholder run per frame
group. Its timestamps are kept in model_specific_data["video_timestamps"] (float64 [t]) so that a
preprocessing-cache hit or caller-supplied input_ids expand exactly as HF would.

Positions (transformers' Qwen3VLModel.get_rope_index): every frame group is its own grid (1, h, w); the
timestamp text between groups takes ordinary text positions. Images are as in Qwen2-VL.

Embeddings are [num_tokens, hidden * (1 + DeepStack levels)] (see tessera.models.qwen3_vl), which is the
width a caller's precomputed embedding must have.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tessera.multimodal.hashing import hash_item
from tessera.messages.items import Modality, MultimodalInputs
from tessera.multimodal.media import VideoClip
from tessera.multimodal.mrope import VisionSpan, compute_mrope_positions
from tessera.multimodal.processors.base import (
    InputFormat,
    ItemFeatures,
    LoadedMultimodalData,
)
from tessera.multimodal.processors.qwen_vl import QwenVLProcessor, temporal_patch_size

__all__ = ["Qwen3VLProcessor", "frame_timestamps"]

DEFAULT_FPS = 24.0  # what transformers assumes for frames whose source rate is unknown
TIMESTAMPS_KEY = "video_timestamps"


def frame_timestamps(indices: Sequence[int], fps: float | None, temporal_patch_size: int) -> list[float]:
    """Seconds of each frame group: indices padded with the last one to a multiple of temporal_patch_size,
    then the mean of each group's first and last frame time (transformers' _calculate_timestamps)."""
    idx = [int(i) for i in indices]
    if len(idx) % temporal_patch_size:
        idx += [idx[-1]] * (temporal_patch_size - len(idx) % temporal_patch_size)
    rate = fps if fps else DEFAULT_FPS
    seconds = [i / rate for i in idx]
    step = temporal_patch_size
    return [(seconds[i] + seconds[i + step - 1]) / 2 for i in range(0, len(seconds), step)]


def deepstack_levels(vision_config: Any) -> int:
    """DeepStack levels the tower adds to each item's embedding rows (Qwen3.5's tower has none: its config has
    no deepstack_visual_indexes)."""
    return len(getattr(vision_config, "deepstack_visual_indexes", None) or ())


class Qwen3VLProcessor(QwenVLProcessor):
    """Qwen3VLForConditionalGeneration."""

    def __init__(self, hf_processor: Any, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(hf_processor, hf_config, *args, **kwargs)
        self.tokens_per_second = None  # frame groups are placed by their timestamp text, not time-scaled
        levels = deepstack_levels(hf_config.vision_config)  # none: Cosmos3 Edge, GLM-4V, Qwen3.5
        self.embed_dim = int(hf_config.get_text_config().hidden_size) * (1 + levels)
        self.temporal_patch_size = temporal_patch_size(hf_config.vision_config)
        self._tokenizer = getattr(hf_processor, "tokenizer", hf_processor)
        self.vision_start_id, self.vision_end_id = self.frame_bracket_ids()

    def frame_bracket_ids(self) -> tuple[int, int]:
        """The ids that open and close each frame group's placeholder run."""
        return (int(getattr(self.hf_config, "vision_start_token_id", None)
                    or self._tokenizer.convert_tokens_to_ids("<|vision_start|>")),
                int(getattr(self.hf_config, "vision_end_token_id", None)
                    or self._tokenizer.convert_tokens_to_ids("<|vision_end|>")))

    # ------------------------------------------------------------ timestamps

    def timestamps(self, indices: Sequence[int], fps: float | None) -> list[float]:
        """Seconds of each frame group of frames `indices` of a source at `fps` (None: unknown)."""
        return frame_timestamps(indices, fps, self.temporal_patch_size)

    def _clip_timestamps(self, clip: VideoClip) -> list[float]:
        return self.timestamps(clip.sampled_indices, clip.fps)

    def video_call_kwargs(self, videos: Sequence[VideoClip]) -> dict[str, Any]:
        """HF writes the timestamps from each clip's metadata (fps None: HF's 24)."""
        return {"video_metadata": [
            {"fps": clip.fps, "total_num_frames": clip.total_num_frames, "frames_indices": list(clip.sampled_indices)}
            for clip in videos
        ]}

    def _raw_hashes(self, loaded: LoadedMultimodalData) -> list[int]:
        """As the base, but a video's hash also covers its timestamps (equal frames from another part of a
        source, or at another rate, expand to other text)."""
        hashes = super()._raw_hashes(loaded)
        if loaded.videos:
            kwargs = self.feature_kwargs(Modality.VIDEO)
            first = len(loaded.images)
            for i, clip in enumerate(loaded.videos):
                hashes[first + i] = hash_item([clip.frames, clip.sampled_fps],
                                              {**kwargs, "timestamps": self._clip_timestamps(clip)})
        return hashes

    def _with_timestamps(self, features: list[ItemFeatures], timestamps: list[list[float]]) -> list[ItemFeatures]:
        videos = [f for f in features if f.modality is Modality.VIDEO]
        assert len(videos) == len(timestamps)
        for f, stamps in zip(videos, timestamps):
            t = int(f.model_specific_data["video_grid_thw"].view(3)[0])
            if len(stamps) != t:
                raise ValueError(f"a video with {t} frame groups has {len(stamps)} timestamps")
            f.model_specific_data[TIMESTAMPS_KEY] = torch.tensor(stamps, dtype=torch.float64)
        return features

    def split_hf_output(self, hf_output: Mapping[str, Any], loaded: LoadedMultimodalData) -> list[ItemFeatures]:
        features = super().split_hf_output(hf_output, loaded)
        return self._with_timestamps(features, [self._clip_timestamps(clip) for clip in loaded.videos])

    def split_preprocessed(self, modality: Modality, data: Mapping[str, Any],
                           input_format: InputFormat) -> list[ItemFeatures]:
        """As Qwen2-VL's; a video dict may carry `video_timestamps` (seconds per frame group, all its videos'
        in order); without it a video is timed as HF times frames without metadata (indices 0.. at 24 fps)."""
        features = super().split_preprocessed(modality, data, input_format)
        if modality is not Modality.VIDEO:
            return features
        grids = [int(f.model_specific_data["video_grid_thw"].view(3)[0]) for f in features]
        given = data.get(TIMESTAMPS_KEY)
        if given is None:
            stamps = [self.timestamps(range(t * self.temporal_patch_size), None) for t in grids]
        else:
            flat = torch.as_tensor(given, dtype=torch.float64).reshape(-1).tolist()
            if len(flat) != sum(grids):
                raise ValueError(f"video_timestamps has {len(flat)} values; video_grid_thw needs {sum(grids)} "
                                 "(one per frame group)")
            bounds = [sum(grids[:i]) for i in range(len(grids) + 1)]
            stamps = [flat[a:b] for a, b in zip(bounds, bounds[1:])]
        return self._with_timestamps(features, stamps)

    # ------------------------------------------------------------ placeholders

    def _video_ids(self, feature: ItemFeatures) -> list[int]:
        """The ids HF's processor puts in place of one video's placeholder."""
        t, h, w = feature.model_specific_data["video_grid_thw"].view(3).tolist()
        pads = [self.special_tokens.video_token_id] * (h * w // self.spatial_merge_size**2)
        out: list[int] = []
        for seconds in feature.model_specific_data[TIMESTAMPS_KEY].tolist():
            out += self._tokenizer(f"<{seconds:.1f} seconds>", add_special_tokens=False)["input_ids"]
            out += [self.vision_start_id, *pads, self.vision_end_id]
        return out

    def expand_placeholders(self, input_ids: list[int], features: Sequence[ItemFeatures]) -> list[int]:
        """Videos given as one placeholder each become their timestamped frame groups; the rest (and runs
        already expanded, e.g. by the HF processor) as the base does."""
        videos = [f for f in features if f.modality is Modality.VIDEO]
        video_id = self.special_tokens.video_token_id
        found = sum(1 for t in input_ids if t == video_id)
        if videos and found == len(videos) and found != sum(f.num_tokens for f in videos):
            expansions = iter([self._video_ids(f) for f in videos])
            expanded: list[int] = []
            for t in input_ids:
                if t == video_id:
                    expanded += next(expansions)
                else:
                    expanded.append(t)
            input_ids = expanded
        return super().expand_placeholders(input_ids, features)

    # ------------------------------------------------------------ positions

    def finalize(self, input_ids: list[int], mm_inputs: MultimodalInputs) -> None:
        self.compute_positions(input_ids, mm_inputs, self.spatial_merge_size)

    @staticmethod
    def compute_positions(input_ids: list[int], mm_inputs: MultimodalInputs, spatial_merge_size: int) -> None:
        """Fill mrope_positions [3, len(input_ids)] and mrope_position_delta: an image is one grid, a video
        one grid (1, h, w) per frame group, each group's placeholder run its own span."""
        spans = []
        for item in mm_inputs.items:
            if item.modality is Modality.IMAGE:
                grid = item.model_specific_data["image_grid_thw"].view(3).tolist()
                if len(item.offsets) != 1:
                    raise ValueError(f"an image item's placeholder tokens must be contiguous, got runs {item.offsets}")
                spans.append(VisionSpan(item.offsets[0][0], (grid[0], grid[1], grid[2])))
                continue
            t, h, w = item.model_specific_data["video_grid_thw"].view(3).tolist()
            per_group = h * w // spatial_merge_size**2
            if len(item.offsets) != t or any(e - s != per_group for s, e in item.offsets):
                raise ValueError(f"a video of grid {(t, h, w)} needs {t} placeholder runs of {per_group} "
                                 f"tokens, one per frame group separated by its timestamp; got runs {item.offsets}")
            spans += [VisionSpan(s, (1, h, w)) for s, _ in item.offsets]
        positions, delta = compute_mrope_positions(len(input_ids), spans, spatial_merge_size)
        mm_inputs.mrope_positions = positions
        mm_inputs.mrope_position_delta = delta
