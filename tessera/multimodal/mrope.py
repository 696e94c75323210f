"""Qwen2-VL multimodal rotary positions (M-RoPE): a prompt's, and any step's tokens of a request.

Contract (identical to transformers 5.x `Qwen2VLModel.get_rope_index` for one unpadded
sequence whose vision items are separated by text, as chat templates always do):
- text tokens get the same position on all three axes, counting up by one;
- a vision item with grid (t, h, w) and spatial merge m has (t, h/m, w/m) tokens whose
  (temporal, height, width) positions are (start + floor(ti * time_interval), start + hi, start + wi);
- the text after it resumes at start + max(h, w) / m (the temporal extent is not counted);
- `delta` = max position + 1 - prompt length; decode token i (0-based from the prompt end)
  takes position prompt_len + i + delta on all three axes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["VisionSpan", "compute_mrope_positions", "generated_positions", "segment_mrope_positions"]


@dataclass(frozen=True)
class VisionSpan:
    """One vision item's placeholder run in the prompt."""

    start: int  # offset of its first placeholder token
    grid_thw: tuple[int, int, int]  # patch grid before spatial merge
    time_interval: float = 1.0  # temporal position step per grid frame (Qwen2.5-VL: tokens/s x s/grid)


def _vision_positions(start: int, span: VisionSpan, merge: int) -> torch.Tensor:
    t, h, w = span.grid_thw
    llm_h, llm_w = h // merge, w // merge
    # Temporal index is scaled before the offset, as HF does, so fractional intervals floor the same way.
    pos_t = (torch.arange(t) * span.time_interval).long() + start
    pos_h = torch.arange(llm_h) + start
    pos_w = torch.arange(llm_w) + start
    grid = torch.meshgrid(pos_t, pos_h, pos_w, indexing="ij")
    return torch.stack(grid, dim=0).reshape(3, -1)


def compute_mrope_positions(seq_len: int, spans: Sequence[VisionSpan],
                            spatial_merge_size: int) -> tuple[torch.Tensor, int]:
    """Positions [3, seq_len] (int64) and the decode delta for a prompt of `seq_len` tokens
    whose vision items occupy `spans` (each t*h*w/merge**2 tokens from span.start)."""
    merge = spatial_merge_size
    pieces: list[torch.Tensor] = []
    cursor = 0  # next token index to place
    pos = 0  # next position value
    for span in sorted(spans, key=lambda s: s.start):
        t, h, w = span.grid_thw
        if h % merge or w % merge:
            raise ValueError(f"grid {span.grid_thw} is not divisible by spatial_merge_size {merge}")
        num_tokens = t * (h // merge) * (w // merge)
        if span.start < cursor or span.start + num_tokens > seq_len:
            raise ValueError(f"vision span at {span.start} with {num_tokens} tokens overlaps or exceeds the prompt")
        if span.start > cursor:
            text_len = span.start - cursor
            pieces.append(torch.arange(text_len).view(1, -1).expand(3, -1) + pos)
            pos += text_len
        pieces.append(_vision_positions(pos, span, merge))
        pos += max(h, w) // merge
        cursor = span.start + num_tokens
    if cursor < seq_len:
        pieces.append(torch.arange(seq_len - cursor).view(1, -1).expand(3, -1) + pos)
    if not pieces:
        return torch.zeros(3, 0, dtype=torch.long), 0
    positions = torch.cat(pieces, dim=1).to(torch.long)
    delta = int(positions.max()) + 1 - seq_len
    return positions, delta


def generated_positions(start: int, end: int, delta: int) -> range:
    """Positions (the same on all three axes) of generated tokens with sequence indices start..end-1:
    the prompt's positions continued at index + delta."""
    return range(start + delta, end + delta)


def segment_mrope_positions(start: int, end: int, prompt_len: int, prompt_positions: torch.Tensor | None,
                            delta: int) -> torch.Tensor:
    """Positions [3, end - start] (int64) of sequence tokens [start, end) of a request whose prompt has
    prompt_len tokens: the prompt's from `prompt_positions` ([3, prompt_len]; None: a text prompt, its
    index on all three axes), generated tokens at generated_positions."""
    parts = []
    if start < prompt_len:
        stop = min(end, prompt_len)
        if prompt_positions is not None:
            parts.append(prompt_positions[:, start:stop])
        else:
            parts.append(torch.arange(start, stop, dtype=torch.long).expand(3, -1))
    if end > prompt_len:
        gen = generated_positions(max(start, prompt_len), end, delta)
        parts.append(torch.arange(gen.start, gen.stop, dtype=torch.long).expand(3, -1))
    return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
