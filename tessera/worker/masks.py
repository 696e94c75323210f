"""Attention masks from bidirectional token spans (media that attend both ways inside their span)."""

from __future__ import annotations

import torch


def span_mask(spans: list[tuple[int, int]], prefix_len: int, seq_len: int,
              device: torch.device | str = "cpu") -> torch.Tensor | None:
    """Bool [seq_len - prefix_len, seq_len] (True = may attend) for the queries prefix_len..seq_len-1:
    causal, plus every query inside a span sees the whole span. None when no span holds a query (the
    backend's plain causal path then serves the request).

    The scheduler never splits a span across steps, so a span holding a query lies inside [0, seq_len);
    one that does not is a scheduling bug and raises.
    """
    live = [(lo, hi) for lo, hi in spans if lo < seq_len and hi > prefix_len]
    if not live:
        return None
    q = torch.arange(prefix_len, seq_len, device=device)
    k = torch.arange(seq_len, device=device)
    mask = k[None, :] <= q[:, None]
    for lo, hi in live:
        if lo < prefix_len or hi > seq_len:
            raise ValueError(f"bidirectional span [{lo}, {hi}) is split by the step's tokens "
                             f"[{prefix_len}, {seq_len})")
        inside_q = (q >= lo) & (q < hi)
        inside_k = (k >= lo) & (k < hi)
        mask |= inside_q[:, None] & inside_k[None, :]
    return mask
