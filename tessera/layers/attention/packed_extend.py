"""Many short prefill chunks of one step attended in one padded SDPA call per layer (torch_native.py).

The extend path runs one SDPA call per request (its own prefix and causal mask). For a step of many short
prompts that is most of the attention's time: 64 embedding requests of ~10-token captions on demo-vl made
64 calls per layer, each with its gather and transposes, for a few rows of queries. Here the requests'
queries are padded to the longest chunk [B, E] and their keys to the longest sequence [B, L] (prefix and
chunk, read from the pool, where this step's K/V were written before attention), and one boolean mask says
what each query sees: the keys up to its own position, as the per-request masks did. Padding rows see key 0
only (no all-masked row, whose softmax would be NaN) and are dropped.

Only when every key comes from the pool in the queries' dtype (a prefix-free request's per-request call read
its fresh K/V rows instead: the same values only then), with at least PACK_MIN_REQUESTS requests and no
sequence longer than PACK_MAX_SEQ (padding to the longest would cost more than the calls it saves).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tessera.platform.device import is_host

PACK_MIN_REQUESTS = 4
PACK_MAX_SEQ = 256


@dataclass
class PackedExtends:
    members: list[tuple[int, int, int, int]]  # (start, extend_len, prefix_len, req row) of each packed request
    q_rows: torch.Tensor  # [B, E] flat query rows (a padding row repeats its request's first)
    out_rows: torch.Tensor  # [n] the flat rows of the valid queries, in the order mask[valid] lists them
    valid: torch.Tensor  # bool [B, E]
    slots: torch.Tensor  # [B, L] KV slots, padding -> the dummy slot 0
    q_pos: torch.Tensor  # [B, E, 1] absolute position of each query
    # sliding window (None: none) -> bool [B, 1, E, L]; ("additive", window) -> the float form per query head
    masks: dict = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor:
        if window not in self.masks:
            k_pos = torch.arange(self.slots.shape[1], device=self.slots.device)[None, None, :]
            seen = k_pos <= self.q_pos
            if window is not None:
                seen &= k_pos > self.q_pos - window
            valid = self.valid[:, :, None]
            self.masks[window] = ((seen & valid) | (~valid & (k_pos == 0)))[:, None]
        return self.masks[window]


def plan(members: list[tuple[int, int, int, int]], req_to_token: torch.Tensor) -> PackedExtends | None:
    """The packed form of `members` (start, extend_len, prefix_len, req row), or None when too few or too
    long to pay."""
    if len(members) < PACK_MIN_REQUESTS or max(ext + pre for _, ext, pre, _ in members) > PACK_MAX_SEQ:
        return None
    device = req_to_token.device
    start, ext, prefix, rows = (torch.tensor(col, dtype=torch.int64, device=device) for col in zip(*members))
    seq = ext + prefix
    e = torch.arange(int(ext.max()), device=device)[None, :]
    valid = e < ext[:, None]
    q_rows = start[:, None] + torch.minimum(e, ext[:, None] - 1)
    length = int(seq.max())
    slots = req_to_token[rows, :length].masked_fill(torch.arange(length, device=device)[None, :] >= seq[:, None], 0)
    return PackedExtends(members, q_rows, q_rows[valid], valid, slots, (prefix[:, None] + e)[:, :, None])


def attend(packed: PackedExtends, q: torch.Tensor, pool, layer_id: int, scaling: float, enable_gqa: bool,
           window: int | None, out: torch.Tensor) -> None:
    """Writes the packed requests' attention output (rows of `out`, [T, H * D]) for layer `layer_id`."""
    k, v = pool.gather(layer_id, packed.slots, q.dtype)  # [B, L, Hkv, D]
    qb, k, v = q[packed.q_rows].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H|Hkv, E|L, D]
    if is_host(q.device) and q.dtype == torch.float32:
        o = _matmul_attention(packed, qb, k, v, scaling, window)
    else:
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=packed.mask(window), scale=scaling,
                                           enable_gqa=enable_gqa)
    out[packed.out_rows] = o.transpose(1, 2)[packed.valid].reshape(-1, out.shape[1])


def _matmul_attention(packed: PackedExtends, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                      window: int | None) -> torch.Tensor:
    """q [B, H, E, D] over k, v [B, Hkv, L, D] as scores, softmax and product: torch's CPU flash kernel took
    0.77 ms a call at demo-vl's shape (64 requests, 4 heads, chunks of ~4 and sequences of ~11 tokens), for
    a few thousand scores. A kv head's G query heads are stacked as G x E query rows (no repeated K/V), as
    torch_native's decode path does; one additive mask per step and window, shared by every layer."""
    batch, heads, rows, dim = q.shape
    group = heads // k.shape[1]
    key = ("additive", window)
    if key not in packed.masks:
        seen = packed.mask(window).repeat(1, 1, group, 1)  # [B, 1, G * E, L], query head g's rows g*E...
        packed.masks[key] = torch.zeros(seen.shape, dtype=q.dtype, device=q.device).masked_fill_(~seen, float("-inf"))
    scores = torch.matmul(q.reshape(batch, k.shape[1], group * rows, dim), k.transpose(-1, -2)).mul_(scaling)
    o = torch.matmul(torch.softmax(scores.add_(packed.masks[key]), dim=-1), v)
    return o.reshape(batch, heads, rows, dim)
