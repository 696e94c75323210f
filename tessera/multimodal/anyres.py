"""LLaVA-NeXT "anyres" geometry: pick a tiling resolution, count tiles and tokens, unpad features.

Convention (as transformers, unlike SGLang's mm_utils which uses (width, height)): every size
is (height, width). The choice rule: maximise the effective resolution (the image scaled to
fit the candidate, never above the original pixel count), then minimise the wasted area.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = [
    "select_best_resolution",
    "get_anyres_image_grid_shape",
    "image_size_to_num_patches",
    "get_patch_output_size",
    "unpad_image",
    "get_unpadded_features",
    "get_anyres_num_image_tokens",
]

Size = tuple[int, int]


def _size(value: Sequence[int] | torch.Tensor) -> Size:
    if isinstance(value, torch.Tensor):
        value = value.tolist()
    height, width = (int(v) for v in value)
    if height <= 0 or width <= 0:
        raise ValueError(f"size must be positive (height, width), got {(height, width)}")
    return height, width


def select_best_resolution(original_size: Sequence[int], possible_resolutions: Sequence[Sequence[int]]) -> Size:
    """The candidate (height, width) that shows `original_size` (height, width) at the highest
    effective resolution, ties broken by least wasted area, then by list order."""
    orig_h, orig_w = _size(original_size)
    if not possible_resolutions:
        raise ValueError("possible_resolutions is empty")
    best: Size | None = None
    best_effective, best_wasted = -1, math.inf
    for candidate in possible_resolutions:
        h, w = _size(candidate)
        scale = min(w / orig_w, h / orig_h)
        effective = min(int(orig_w * scale) * int(orig_h * scale), orig_w * orig_h)
        wasted = h * w - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (h, w), effective, wasted
    assert best is not None
    return best


def get_anyres_image_grid_shape(image_size: Sequence[int] | torch.Tensor,
                                grid_pinpoints: Sequence[Sequence[int]], patch_size: int) -> Size:
    """Tiles (rows, cols) of `patch_size`-sized crops covering the best resolution."""
    h, w = select_best_resolution(_size(image_size), grid_pinpoints)
    return h // patch_size, w // patch_size


def image_size_to_num_patches(image_size: Sequence[int] | torch.Tensor,
                              grid_pinpoints: Sequence[Sequence[int]], patch_size: int) -> int:
    """Crops the processor produces: every tile (partial tiles count) plus the base image."""
    h, w = select_best_resolution(_size(image_size), grid_pinpoints)
    return math.ceil(h / patch_size) * math.ceil(w / patch_size) + 1


def get_patch_output_size(original_size: Sequence[int], target_resolution: Sequence[int]) -> Size:
    """(height, width) of the image resized to fit `target_resolution` keeping its aspect ratio
    (the remainder is padding)."""
    orig_h, orig_w = _size(original_size)
    target_h, target_w = _size(target_resolution)
    scale_w, scale_h = target_w / orig_w, target_h / orig_h
    if scale_w < scale_h:
        return min(math.ceil(orig_h * scale_w), target_h), target_w
    return target_h, min(math.ceil(orig_w * scale_h), target_w)


def unpad_image(tensor: torch.Tensor, original_size: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Crop the centred padding off a (channels, height, width) feature map that holds an image
    of `original_size` (height, width) resized to fit."""
    orig_h, orig_w = _size(original_size)
    cur_h, cur_w = tensor.shape[1:]
    if orig_w / orig_h > cur_w / cur_h:
        new_h = int(round(orig_h * (cur_w / orig_w), 7))  # round(.., 7) absorbs float noise
        pad = (cur_h - new_h) // 2
        return tensor[:, pad: cur_h - pad, :]
    new_w = int(round(orig_w * (cur_h / orig_h), 7))
    pad = (cur_w - new_w) // 2
    return tensor[:, :, pad: cur_w - pad]


def get_unpadded_features(height: int, width: int, patches_height: int, patches_width: int,
                          scale_height: int, scale_width: int) -> tuple[int, int]:
    """(unpadded feature count, newline count) for an image of (height, width) whose tiles
    form a (scale_height x patches_height, scale_width x patches_width) feature map."""
    cur_h, cur_w = patches_height * scale_height, patches_width * scale_width
    if width / height > cur_w / cur_h:
        new_h = int(round(height * (cur_w / width), 7))
        cur_h -= (cur_h - new_h) // 2 * 2
    else:
        new_w = int(round(width * (cur_h / height), 7))
        cur_w -= (cur_w - new_w) // 2 * 2
    return cur_h * cur_w, cur_h


def get_anyres_num_image_tokens(original_size: Sequence[int], grid_pinpoints: Sequence[Sequence[int]],
                                tile_size: int, vit_patch_size: int, num_additional_tokens: int = 0) -> int:
    """Placeholder tokens of one LLaVA-NeXT image: base tile + unpadded tiles + one newline per row."""
    orig_h, orig_w = _size(original_size)
    best_h, best_w = select_best_resolution((orig_h, orig_w), grid_pinpoints)
    patches = tile_size // vit_patch_size
    unpadded, newlines = get_unpadded_features(orig_h, orig_w, patches, patches,
                                               best_h // tile_size, best_w // tile_size)
    return unpadded + newlines + patches * patches + num_additional_tokens
