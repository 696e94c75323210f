"""Media geometry the processors and the models share: how many placeholder tokens an item becomes and the
keys of the per-item data that carry its shape. Read from the HF config; it needs no model code, so the
processors (frontend) import it without importing the models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tessera.multimodal import anyres

IMAGE_SIZES_KEY = "image_sizes"  # LLaVA-NeXT model_specific_data: the original (height, width), [1, 2] int64
FEATURE_MASK_KEY = "feature_attention_mask"  # Qwen2-Audio model_specific_data: which mel frames are real audio


def tokens_per_tile(vision_config: Any) -> int:
    """Placeholder tokens one tile becomes: its patches after the pixel shuffle."""
    size, patch = int(vision_config.image_size), int(vision_config.patch_size)
    downsample = int(round(1.0 / float(vision_config.pixel_shuffle_ratio) ** 2))
    return (size // patch) ** 2 // downsample


def audio_output_len(num_frames: int) -> int:
    """Audio tokens for `num_frames` valid mel frames: conv2 (stride 2) then the 2x average pool, the
    arithmetic of transformers' `_get_feat_extract_output_lengths` and of Qwen2AudioProcessor."""
    after_conv = (num_frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


SPEECH_MASK_KEY = "input_features_mask"  # Qwen3-ASR / GLM-ASR model_specific_data: which mel frames are real audio


def qwen3_asr_output_len(num_frames: int, n_window: int) -> int:
    """Qwen3-ASR audio tokens for `num_frames` valid mel frames: the frames are cut into chunks of 2 * n_window,
    each chunk goes through three stride-2 convolutions on its own (a full chunk of 100 frames gives 13 tokens),
    as transformers' `_get_feat_extract_output_lengths` and Qwen3ASRProcessor count them."""
    chunk = 2 * n_window
    full, rest = divmod(num_frames, chunk)
    for _ in range(3):
        rest = (rest - 1) // 2 + 1 if rest > 0 else 0
    tokens_per_chunk = chunk
    for _ in range(3):
        tokens_per_chunk = (tokens_per_chunk - 1) // 2 + 1
    return full * tokens_per_chunk + rest


GLM_ASR_MERGE = 4  # GLM-ASR's projector reads four encoder frames as one token


def glm_asr_output_len(num_frames: int) -> int:
    """GLM-ASR audio tokens for one window of `num_frames` valid mel frames: conv1 keeps the length, conv2
    halves it, then four frames make one token (GlmAsrProcessor's and GlmAsrModel's arithmetic)."""
    after_conv = (num_frames - 1) // 2 + 1
    return (after_conv - GLM_ASR_MERGE) // GLM_ASR_MERGE + 1


# vision_config.model_type -> (transformers tower class, whether it prepends a CLS token to the patches)
VISION_TOWERS: dict[str, tuple[str, bool]] = {
    "clip_vision_model": ("transformers.models.clip.modeling_clip:CLIPVisionModel", True),
    "siglip_vision_model": ("transformers.models.siglip.modeling_siglip:SiglipVisionModel", False),
}


@dataclass(frozen=True)
class LlavaImageGeometry:
    """How many tiles and tokens an image becomes, read from the model config (the processor and the model
    both use it). `grid_pinpoints` is set for LLaVA-NeXT's anyres tiling, None for LLaVA-1.5's single crop."""

    image_size: int  # the tower's input side in pixels (one tile)
    patch_size: int
    num_channels: int
    has_cls: bool  # the tower prepends a CLS token
    select_strategy: str  # "default" (drop the CLS token) | "full"
    grid_pinpoints: tuple[tuple[int, int], ...] | None = None

    @classmethod
    def from_config(cls, hf_config: Any) -> LlavaImageGeometry:
        vision = hf_config.vision_config
        vision_type = str(getattr(vision, "model_type", ""))
        if vision_type not in VISION_TOWERS:
            raise NotImplementedError(f"vision_config.model_type={vision_type!r}: LLaVA's vision tower may be "
                                      f"{' or '.join(sorted(VISION_TOWERS))}")
        strategy = str(getattr(hf_config, "vision_feature_select_strategy", "default"))
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy={strategy!r}: expected 'default' or 'full'")
        pinpoints = getattr(hf_config, "image_grid_pinpoints", None)
        return cls(
            image_size=int(vision.image_size), patch_size=int(vision.patch_size),
            num_channels=int(getattr(vision, "num_channels", 3)), has_cls=VISION_TOWERS[vision_type][1],
            select_strategy=strategy,
            grid_pinpoints=tuple((int(h), int(w)) for h, w in pinpoints) if pinpoints is not None else None,
        )

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def tokens_per_tile(self) -> int:
        """Feature rows the tower gives per tile after the select strategy."""
        return self.patches_per_side**2 + int(self.has_cls) - int(self.select_strategy == "default")

    def num_tiles(self, image_size: tuple[int, int] | None = None) -> int:
        """Tiles of an image of (height, width) `image_size`: 1 for LLaVA-1.5; the anyres grid + the base
        image for LLaVA-NeXT."""
        if self.grid_pinpoints is None:
            return 1
        assert image_size is not None, "anyres tiling needs the image's size"
        return anyres.image_size_to_num_patches(image_size, self.grid_pinpoints, self.image_size)

    def num_image_tokens(self, image_size: tuple[int, int] | None = None) -> int:
        """Placeholder tokens of one image (HF's processors expand `<image>` to exactly this many)."""
        if self.grid_pinpoints is None:
            return self.tokens_per_tile
        assert image_size is not None, "anyres tiling needs the image's size"
        extra = int(self.has_cls) - int(self.select_strategy == "default")
        return anyres.get_anyres_num_image_tokens(image_size, self.grid_pinpoints, self.image_size,
                                                  self.patch_size, num_additional_tokens=extra)
