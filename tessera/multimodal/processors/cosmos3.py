"""Cosmos3-Edge processor: Qwen3-VL's (images, videos as timestamped frames, per-frame M-RoPE positions), except
where a video's frames go.

transformers' Cosmos3EdgeProcessor replaces the chat template's whole `<|vision_start|><|video_pad|>
<|vision_end|>` by the frames (`<{t:.1f} seconds><|vision_start|>` pads `<|vision_end|>` each), where Qwen3-VL
keeps the outer pair around them; a bare `<|video_pad|>` is replaced alone, as in Qwen3-VL. Edge's SigLIP2 tower
patches frame by frame (temporal_patch_size 1) and has no DeepStack, which the Qwen3-VL processor reads from the
config. Cosmos3-Nano is Qwen3-VL and uses Qwen3-VL's processor as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tessera.messages.items import Modality
from tessera.multimodal.media import VideoClip
from tessera.multimodal.processors.base import ItemFeatures
from tessera.multimodal.processors.qwen3_vl import Qwen3VLProcessor

__all__ = ["Cosmos3EdgeProcessor"]


class Cosmos3EdgeProcessor(Qwen3VLProcessor):
    """Cosmos3EdgeForConditionalGeneration."""

    def video_call_kwargs(self, videos: Sequence[VideoClip]) -> dict[str, Any]:
        """Qwen3-VL's metadata; HF's Edge video processor returns it to the processor (which writes the timestamps
        from it) only when asked, where Qwen3-VL's asks by default."""
        return {**super().video_call_kwargs(videos), "return_metadata": True}

    def expand_placeholders(self, input_ids: list[int], features: Sequence[ItemFeatures]) -> list[int]:
        """Videos given as one placeholder each lose the vision start/end pair around it before the frames
        replace it; runs already expanded (by the HF processor) are left as they are."""
        videos = [f for f in features if f.modality is Modality.VIDEO]
        video_id = self.special_tokens.video_token_id
        found = [i for i, t in enumerate(input_ids) if t == video_id]
        if videos and len(found) == len(videos) and len(found) != sum(f.num_tokens for f in videos):
            wrapper = {i + d for i in found if 0 < i < len(input_ids) - 1
                       and input_ids[i - 1] == self.vision_start_id and input_ids[i + 1] == self.vision_end_id
                       for d in (-1, 1)}
            input_ids = [t for i, t in enumerate(input_ids) if i not in wrapper]
        return super().expand_placeholders(input_ids, features)
