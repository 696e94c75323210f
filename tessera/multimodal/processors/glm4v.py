"""GLM-4.1V processor (transformers' Glm4vProcessor): Qwen-style merged ViT patches, a video as timestamped
frames, per-frame M-RoPE positions.

The chat template writes `<|begin_of_image|><|image|><|end_of_image|>` for an image and
`<|begin_of_video|><|video|><|end_of_video|>` for a video. HF's processor expands `<|image|>` into the image's
h*w/merge**2 `<|image|>` tokens, and `<|video|>` into, per frame (a group of temporal_patch_size frames),
`<|begin_of_image|>`, that frame's `<|image|>` tokens, `<|end_of_image|>` and the frame's time in whole seconds as
text: `int(index / fps)` of the group's FIRST source frame (fps 24 when unknown, as HF). A video's frames are
therefore `<|image|>` runs too; what makes them a video's is that they sit between `<|begin_of_video|>` and
`<|end_of_video|>` (HF's mm_token_type_ids say the same). To match `<|image|>` runs to items, runs inside a video
are read as the video placeholder (`_typed`), and the shared assembly code does the rest.

Positions (transformers' Glm4vModel.get_rope_index): an image is one grid, a video one grid (1, h, w) per frame,
the timestamp text between frames ordinary text; the same arithmetic as Qwen3-VL's (`compute_positions`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tessera.messages.items import Modality, MultimodalDataItem
from tessera.multimodal.processors.assemble import ItemFeatures, build_items, expand_placeholders
from tessera.multimodal.processors.qwen3_vl import TIMESTAMPS_KEY, Qwen3VLProcessor
from tessera.multimodal.special_tokens import MultimodalSpecialTokens

__all__ = ["Glm4vProcessor"]

DEFAULT_FPS = 24.0  # what transformers' Glm4vProcessor assumes for frames whose source rate is unknown


class Glm4vProcessor(Qwen3VLProcessor):
    """Glm4vForConditionalGeneration."""

    def __init__(self, hf_processor: Any, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(hf_processor, hf_config, *args, **kwargs)
        tok = self._tokenizer
        self.video_start_id = int(getattr(hf_config, "video_start_token_id", None)
                                  or tok.convert_tokens_to_ids("<|begin_of_video|>"))
        self.video_end_id = int(getattr(hf_config, "video_end_token_id", None)
                                or tok.convert_tokens_to_ids("<|end_of_video|>"))

    def build_special_tokens(self) -> MultimodalSpecialTokens:
        return MultimodalSpecialTokens(
            image_token=getattr(self.hf_processor, "image_token", "<|image|>"),
            video_token=getattr(self.hf_processor, "video_token", "<|video|>"),
            image_token_id=getattr(self.hf_config, "image_token_id", None),
            video_token_id=getattr(self.hf_config, "video_token_id", None),
        )

    def frame_bracket_ids(self) -> tuple[int, int]:
        tok = self._tokenizer
        return (int(getattr(self.hf_config, "image_start_token_id", None)
                    or tok.convert_tokens_to_ids("<|begin_of_image|>")),
                int(getattr(self.hf_config, "image_end_token_id", None)
                    or tok.convert_tokens_to_ids("<|end_of_image|>")))

    def resized(self, height: int, width: int, size: Mapping[str, int]) -> tuple[int, int] | None:
        """Glm4vImageProcessor's resize: its own smart_resize, an image counted as temporal_patch_size frames."""
        from transformers.models.glm4v.image_processing_glm4v import smart_resize

        ip = self.hf_processor.image_processor
        if not type(ip).__name__.startswith("Glm4vImageProcessor"):
            return None
        temporal = int(ip.temporal_patch_size)
        return smart_resize(temporal, height, width, temporal_factor=temporal,
                            factor=int(ip.patch_size) * int(ip.merge_size), min_pixels=size["shortest_edge"],
                            max_pixels=size["longest_edge"])

    def timestamps(self, indices: Sequence[int], fps: float | None) -> list[float]:
        """Seconds of each frame's first source frame: HF's metadata.timestamps[::2] (a step of 2 whatever
        temporal_patch_size is, as transformers writes it)."""
        rate = fps if fps else DEFAULT_FPS
        return [int(i) / rate for i in list(indices)[::2]]

    def _video_ids(self, feature: ItemFeatures) -> list[int]:
        """The ids HF's processor puts in place of one video's `<|video|>`."""
        t, h, w = feature.model_specific_data["video_grid_thw"].view(3).tolist()
        pads = [self.special_tokens.image_token_id] * (h * w // self.spatial_merge_size**2)
        out: list[int] = []
        for seconds in feature.model_specific_data[TIMESTAMPS_KEY].tolist():
            out += [self.vision_start_id, *pads, self.vision_end_id]
            out += self._tokenizer(str(int(seconds)), add_special_tokens=False)["input_ids"]
        return out

    def _typed(self, input_ids: list[int]) -> list[int]:
        """`input_ids` with the `<|image|>` tokens inside a video (between its start and end ids) replaced by
        the video placeholder id, so that the shared assembly code tells images' runs from videos'."""
        image_id, video_id = self.special_tokens.image_token_id, self.special_tokens.video_token_id
        depth, out = 0, []
        for t in input_ids:
            depth += (t == self.video_start_id) - (t == self.video_end_id)
            out.append(video_id if t == image_id and depth > 0 else t)
        return out

    def expand_placeholders(self, input_ids: list[int], features: Sequence[ItemFeatures]) -> list[int]:
        """Each video's `<|video|>` becomes its timestamped frames; then images as the base expands them. Runs
        already expanded (the HF processor's) stay."""
        videos = [f for f in features if f.modality is Modality.VIDEO]
        video_id, image_id = self.special_tokens.video_token_id, self.special_tokens.image_token_id
        found = sum(1 for t in input_ids if t == video_id)
        if found:
            if found != len(videos):
                raise ValueError(f"input_ids have {found} video placeholders ({self.special_tokens.video_token!r}) "
                                 f"but {len(videos)} videos were given")
            expansions = iter([self._video_ids(f) for f in videos])
            input_ids = [x for t in input_ids for x in (next(expansions) if t == video_id else [t])]
        typed = self._typed(input_ids)
        in_videos = sum(1 for t in typed if t == video_id)
        if videos and in_videos != sum(f.num_tokens for f in videos):
            raise ValueError(f"{len(videos)} video(s) need {sum(f.num_tokens for f in videos)} frame tokens between "
                             f"<|begin_of_video|> and <|end_of_video|>, found {in_videos}; format the prompt with "
                             "the chat template")
        return [image_id if t == video_id else t for t in expand_placeholders(typed, features, self.special_tokens)]

    def _build_items(self, input_ids: list[int], features: Sequence[ItemFeatures],
                     hashes: Sequence[int]) -> list[MultimodalDataItem]:
        return build_items(self._typed(input_ids), features, hashes, self.special_tokens)
