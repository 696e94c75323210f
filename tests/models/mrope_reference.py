"""Test oracle: M-RoPE (Qwen2-VL) positions from input ids and grids, as transformers computes them.

Text tokens advance all three rows together; a vision item of grid (t, h, w) occupies t*h*w/merge**2 tokens
whose rows are (t index, h index, w index) offset by the position where the item starts. After a prompt,
token k (0-based) sits at position k + delta in all three rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tessera.multimodal.mrope import VisionSpan
from tessera.multimodal.mrope import compute_mrope_positions as compute_positions_from_spans


def text_mrope_positions(start: int, length: int, delta: int) -> torch.Tensor:
    """Positions [3, length] of text tokens with sequence indices start..start+length-1."""
    return (torch.arange(start, start + length, dtype=torch.long) + delta).expand(3, -1).contiguous()


def decode_mrope_positions(seq_len_before: int, delta: int) -> torch.Tensor:
    """Position [3, 1] of the token appended to a request that already holds seq_len_before tokens."""
    return torch.full((3, 1), seq_len_before + delta, dtype=torch.long)


def _as_grid(g: Sequence[int] | torch.Tensor) -> tuple[int, int, int]:
    t, h, w = (int(x) for x in (g.reshape(-1).tolist() if isinstance(g, torch.Tensor) else g))
    return t, h, w


def compute_mrope_positions(
    input_ids: Sequence[int] | torch.Tensor,
    image_grid_thw: Sequence[Sequence[int] | torch.Tensor] | torch.Tensor | None,
    video_grid_thw: Sequence[Sequence[int] | torch.Tensor] | torch.Tensor | None,
    spatial_merge_size: int,
    image_token_id: int,
    video_token_id: int,
    vision_start_token_id: int | None = None,
) -> tuple[torch.Tensor, int]:
    """Positions [3, L] long and the decode delta for one prompt, equal to transformers 5.x
    Qwen2VLModel.get_rope_index (the oracle the demo model was trained with).

    Placeholder tokens are matched to grids in order, per modality; each item consumes exactly
    t*h*w/merge**2 tokens of its placeholder id (so two adjacent items need no separator). The position
    arithmetic is tessera.multimodal.mrope's (the processor's), so the two can never disagree.
    `vision_start_token_id` is accepted for signature compatibility; placeholders are found directly.
    Raises ValueError if placeholders and grids disagree.
    """
    ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
    grids = {
        image_token_id: [_as_grid(g) for g in (image_grid_thw if image_grid_thw is not None else [])],
        video_token_id: [_as_grid(g) for g in (video_grid_thw if video_grid_thw is not None else [])],
    }
    used = {image_token_id: 0, video_token_id: 0}
    spans: list[VisionSpan] = []
    i, n = 0, len(ids)
    while i < n:
        tok = ids[i]
        if tok not in grids:
            i += 1
            continue
        name = "image" if tok == image_token_id else "video"
        if used[tok] >= len(grids[tok]):
            raise ValueError(f"more {name} placeholder spans than {name}_grid_thw rows ({len(grids[tok])})")
        t, h, w = grids[tok][used[tok]]
        used[tok] += 1
        num = t * (h // spatial_merge_size) * (w // spatial_merge_size)
        if ids[i:i + num] != [tok] * num:
            raise ValueError(
                f"{name} {used[tok] - 1} with grid {(t, h, w)} needs {num} consecutive placeholder tokens at {i}"
            )
        spans.append(VisionSpan(start=i, grid_thw=(t, h, w)))
        i += num
    for tok, name in ((image_token_id, "image"), (video_token_id, "video")):
        if used[tok] != len(grids[tok]):
            raise ValueError(f"{len(grids[tok])} {name}_grid_thw rows but {used[tok]} {name} placeholder spans")
    return compute_positions_from_spans(n, spans, spatial_merge_size)
