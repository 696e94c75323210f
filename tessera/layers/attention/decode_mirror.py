"""Contiguous copies of the decoding requests' K/V, kept across steps (torch_native backend, decode only).

Why: SDPA needs each request's K/V contiguous, while the pool scatters them over pages. Gathering them
every step costs a full read and write of every running request's K/V per layer; at batch 32 x 256
tokens that gather was half of demo-vl's decode step, where HF's DynamicCache only appends. The mirror
makes a decode step append one token per request instead: row j of every layer's mirror holds the K/V
of one decoding request, filled from the pool once (its first decode step) and then kept.

Invariants, re-established by `plan()` once per step before layer 0:
  - the decoding requests of the step occupy rows 0..B-1 (no holes: a request that leaves frees its
    row and the last row moves into it), so SDPA runs over rows [:B] as one batch;
  - a row belongs to (req_to_token row, its allocation generation): a slot-table row reused by another
    request, or re-admitted after retraction, never inherits a stale mirror;
  - positions past a row's length hold finite values (the buffers start zeroed), so masked keys stay
    harmless in SDPA's weighted sum.
The pool stays the source of truth; the mirror is dropped whenever it would outgrow the pool itself, and
that step (and any step whose ForwardBatch has no generations) gathers from the pool as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessera.cache.kv_pool import TokenToKVPool


@dataclass
class MirrorPlan:
    """What each layer does to the mirror in this step, then where each decode request's row is."""

    rows: torch.Tensor  # [B] mirror row of decode request d (a permutation of 0..B-1)
    identity: bool  # rows == arange(B): no permutation of q / outputs needed
    moves: list[tuple[int, int, int]]  # (src row, dst row, length): compaction, done first
    # Rows that already hold all but this step's token get it appended: append_index[j * Hkv + h] is where
    # kv head h of the j-th append goes in a layer's buffer viewed as [R * Hkv * Tcap, D] (one index_copy_,
    # ~4x faster on CPU than an index_put over (row, :, position)), taking decode request append_src[j]
    # (None: the appends are decode requests 0..B-1 in order, no gather).
    append_index: torch.Tensor | None
    append_src: torch.Tensor | None
    fills: list[tuple[int, torch.Tensor]]  # (row, slots [L]): rows copied from the pool whole
    max_len: int
    mask: torch.Tensor | None  # bool [B, 1, 1, max_len]; None when every row has max_len tokens


class DecodeKVMirror:
    def __init__(self) -> None:
        self.k: list[torch.Tensor] = []  # per layer [R, Hkv, Tcap, D]
        self.v: list[torch.Tensor] = []
        self.row_of: dict[tuple[int, int], int] = {}  # (req_to_token row, generation) -> mirror row
        self.length: list[int] = []  # valid tokens per mirror row

    def clear(self) -> None:
        self.k, self.v, self.row_of, self.length = [], [], {}, []

    def plan(self, keys: list[tuple[int, int]], seq_lens: list[int], slots: list[torch.Tensor],
             pool: TokenToKVPool, dtype: torch.dtype) -> MirrorPlan | None:
        """keys / seq_lens / slots: per decode request, its identity, KV length after this step, and
        its slot row (a view of req_to_token, read lazily by the fills). None: gather this step."""
        batch, max_len = len(keys), max(seq_lens)
        if not self._ensure_capacity(batch, max_len, pool, dtype):
            self.clear()
            return None
        # Requests that left give their rows back; the survivors keep theirs, except rows >= B,
        # which move into the holes below B.
        alive = set(keys)
        old = {key: row for key, row in self.row_of.items() if key in alive}
        holes = sorted(set(range(batch)) - {r for r in old.values() if r < batch})
        moves: list[tuple[int, int, int]] = []
        row_of: dict[tuple[int, int], int] = {}
        for key, row in sorted(old.items(), key=lambda kv: kv[1]):
            if row >= batch:
                dst = holes.pop(0)
                moves.append((row, dst, self.length[row]))
                row = dst
            row_of[key] = row
        length = [0] * batch
        for key, row in row_of.items():
            length[row] = self.length[self.row_of[key]]
        rows, app_rows, app_pos, app_src, fills = [], [], [], [], []
        for d, (key, seq_len) in enumerate(zip(keys, seq_lens)):
            row = row_of.get(key)
            if row is None:
                row = holes.pop(0)
                row_of[key] = row
            if key in old and length[row] == seq_len - 1:
                app_rows.append(row)
                app_pos.append(seq_len - 1)
                app_src.append(d)
            else:
                fills.append((row, slots[d][:seq_len]))
            length[row] = seq_len
            rows.append(row)
        self.row_of, self.length = row_of, length
        device = pool.device
        t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device) if xs else None  # noqa: E731
        append_index = append_from = None
        if app_rows:
            heads, cap = pool.num_kv_heads, self.k[0].shape[2]
            flat = [(row * heads + h) * cap + pos for row, pos in zip(app_rows, app_pos) for h in range(heads)]
            append_index = t(flat)
            append_from = None if app_src == list(range(batch)) else t(app_src)
        mask = None
        if min(seq_lens) != max_len:
            lens = torch.tensor([length[r] for r in range(batch)], device=device)
            mask = (torch.arange(max_len, device=device)[None, :] < lens[:, None])[:, None, None, :]
        return MirrorPlan(t(rows), rows == list(range(batch)), moves, append_index, append_from, fills, max_len,
                          mask)

    def _ensure_capacity(self, batch: int, max_len: int, pool: TokenToKVPool, dtype: torch.dtype) -> bool:
        num_layers = len(pool.k_buffers)
        if self.k and (self.k[0].dtype != dtype or len(self.k) != num_layers):
            self.clear()
        rows, cap = (self.k[0].shape[0], self.k[0].shape[2]) if self.k else (0, 0)
        if batch <= rows and max_len <= cap:
            return True
        # A quarter of headroom in each dimension, so a growing batch or context resizes (a full copy) rarely.
        new_rows = max(rows, batch + batch // 4)
        new_cap = max(cap, -(-(max_len + max_len // 4) // 64) * 64)
        elem = torch.empty((), dtype=dtype).element_size()
        need = 2 * num_layers * new_rows * pool.num_kv_heads * new_cap * pool.head_dim * elem
        # Never more than the pool itself: the mirror is a cache of a subset of it.
        pool_bytes = sum(b.numel() * b.element_size() for b in pool.k_buffers + pool.v_buffers)
        if need > pool_bytes:
            return False
        shape = (new_rows, pool.num_kv_heads, new_cap, pool.head_dim)
        for bufs in (self.k, self.v):
            for i in range(num_layers):
                fresh = torch.zeros(shape, dtype=dtype, device=pool.device)
                if bufs and i < len(bufs):
                    fresh[:rows, :, :cap] = bufs[i]
                    bufs[i] = fresh
                else:
                    bufs.append(fresh)
        return True

    def update_layer(self, layer: int, plan: MirrorPlan, k_new: torch.Tensor, v_new: torch.Tensor,
                     pool: TokenToKVPool) -> tuple[torch.Tensor, torch.Tensor]:
        """Applies the plan to one layer (k_new / v_new: [B, Hkv, D], this step's decode tokens, in
        request order) and returns its K, V as [B, Hkv, max_len, D] views."""
        mk, mv = self.k[layer], self.v[layer]
        for src, dst, n in plan.moves:
            mk[dst, :, :n] = mk[src, :, :n]
            mv[dst, :, :n] = mv[src, :, :n]
        if plan.append_index is not None:
            for buf, new in ((mk, k_new), (mv, v_new)):
                if plan.append_src is not None:
                    new = new.index_select(0, plan.append_src)
                # Through the pool's dtype: the same values a gather would read.
                new = new.to(pool.dtype).to(buf.dtype).reshape(-1, buf.shape[-1])
                buf.view(-1, buf.shape[-1]).index_copy_(0, plan.append_index, new)
        for row, slots in plan.fills:
            k, v = pool.gather(layer, slots, mk.dtype)  # [L, Hkv, D], includes this step's token
            mk[row, :, : len(slots)] = k.transpose(0, 1)
            mv[row, :, : len(slots)] = v.transpose(0, 1)
        batch = plan.rows.numel()
        return mk[:batch, :, : plan.max_len], mv[:batch, :, : plan.max_len]
