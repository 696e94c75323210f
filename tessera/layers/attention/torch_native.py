"""Attention over the paged KV cache with torch's scaled_dot_product_attention (CPU and GPU).

Decode requests (one new token, no custom mask) are batched into ONE attention over their K/V, padded to
the longest of them. Float32 on a CPU: our C kernel reads the pool in place (cpu_decode.py). Otherwise (other
dtypes, GPUs, no C compiler) the K/V are kept contiguous across steps in a DecodeKVMirror when the
ForwardBatch carries request generations (the model worker's batches do), else gathered from the pool, and
attended with SDPA (torch's matmuls for float32 batches of MATMUL_DECODE_MIN_BATCH or more on a CPU, see
_decode_attention). Prefill/extend requests run one SDPA call each, except many short ones without a custom
mask: those share one padded call per layer (packed_extend.py). Gather indices and masks are built once
per step (init_forward_metadata) and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tessera.cache.kv_pool import TokenToKVPool
from tessera.layers.attention import cpu_decode, packed_extend
from tessera.layers.attention.base import BaseAttentionBackend
from tessera.layers.attention.decode_mirror import DecodeKVMirror, MirrorPlan
from tessera.layers.forward_batch import ForwardBatch
from tessera.platform.device import is_host


@dataclass
class _ExtendPlan:
    """One request that runs its own SDPA call (prefill chunk, or any request with a custom mask)."""

    start: int  # first flat row
    extend_len: int
    prefix_len: int
    slots: torch.Tensor | None  # [seq_len] KV slots; None when prefix_len == 0 (use the fresh k/v rows)
    mask: torch.Tensor | None  # bool [extend_len, seq_len]; None = plain causal (prefix_len == 0)


@dataclass
class _StepMetadata:
    fb: ForwardBatch  # the batch this metadata was built for (identity-checked)
    is_all_decode: bool  # every row is a batched decode row (rows == arange(T))
    decode_rows: torch.Tensor | None  # [B_dec] flat rows of the batched decode requests
    decode_slots: torch.Tensor | None  # [B_dec, max_len] KV slots, padding -> slot 0
    decode_mask: torch.Tensor | None  # bool [B_dec, 1, 1, max_len]; None when all lengths are equal
    extends: list[_ExtendPlan]
    mirror_keys: list[tuple[int, int]] | None  # (req row, generation) per decode request; None: no mirror
    decode_lens: list[int]
    mirror_plan: MirrorPlan | None = None  # made on the first layer (it needs the pool)
    mirror_planned: bool = False
    paged: bool = False  # decode reads the pool in place through our C kernel (decided with the mirror plan)
    # masks built once per step: (what, window) -> bool mask; ("additive", id(mask)) -> (mask, float mask)
    step_masks: dict = field(default_factory=dict)
    decode_lens_cpu: torch.Tensor | None = None  # int64 decode_lens for the CPU kernel, built on first use
    packed: packed_extend.PackedExtends | None = None  # short causal extends attended together

    def lens_tensor(self) -> torch.Tensor:
        if self.decode_lens_cpu is None:
            self.decode_lens_cpu = torch.tensor(self.decode_lens, dtype=torch.int64)
        return self.decode_lens_cpu


class TorchNativeAttentionBackend(BaseAttentionBackend):
    """Reference backend; see BaseAttentionBackend for the contract."""

    def __init__(self) -> None:
        self._meta: _StepMetadata | None = None
        self._mirror = DecodeKVMirror()
        self._mirror_layers_left = 0  # layers of the last planned step not yet updated (nonzero: a step failed)

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        self._meta = self._build_metadata(fb)

    def _metadata_for(self, fb: ForwardBatch) -> _StepMetadata:
        if self._meta is None or self._meta.fb is not fb:
            self._meta = self._build_metadata(fb)
        return self._meta

    @staticmethod
    def _build_metadata(fb: ForwardBatch) -> _StepMetadata:
        # Per-request lengths decide the Python-level plan: host copies when the batch has them (no sync).
        extend_lens, seq_lens, starts, rows = fb.host_plan()
        custom = fb.custom_masks or [None] * len(seq_lens)
        assert len(custom) == len(seq_lens), "custom_masks must have one entry per request"
        device = fb.req_to_token.device

        decode_reqs: list[int] = []
        extends: list[_ExtendPlan] = []
        causal: list[tuple[int, int, int, int]] = []  # (start, extend_len, prefix_len, row): no custom mask
        for i, (ext, seq, start) in enumerate(zip(extend_lens, seq_lens, starts)):
            prefix = seq - ext
            if ext == 1 and custom[i] is None:
                decode_reqs.append(i)
                continue
            if ext == 0:
                continue
            mask = custom[i]
            if mask is None:
                causal.append((start, ext, prefix, rows[i]))
                continue
            assert tuple(mask.shape) == (ext, seq), f"custom mask {i}: {tuple(mask.shape)} != {(ext, seq)}"
            slots = fb.req_to_token[rows[i], :seq] if prefix > 0 else None
            extends.append(_ExtendPlan(start, ext, prefix, slots, mask.to(device=device, dtype=torch.bool)))
        packed = packed_extend.plan(causal, fb.req_to_token)
        if packed is None:
            extends += _causal_plans(causal, fb.req_to_token)

        decode_rows = decode_slots = decode_mask = None
        if decode_reqs:
            idx = torch.tensor(decode_reqs, device=device)
            lens = [seq_lens[i] for i in decode_reqs]
            max_len = max(lens)
            decode_rows = torch.tensor([starts[i] for i in decode_reqs], device=device)
            decode_slots = fb.req_to_token[fb.req_pool_indices[idx], :max_len]
            if min(lens) != max_len:
                valid = torch.arange(max_len, device=device)[None, :] < fb.seq_lens[idx][:, None]
                # Padding positions may hold stale slot ids; point them at the dummy slot 0.
                decode_slots = decode_slots.masked_fill(~valid, 0)
                decode_mask = valid[:, None, None, :]
        is_all_decode = not extends and len(decode_reqs) == len(seq_lens)
        gens = fb.req_generations
        keys = [(rows[i], gens[i]) for i in decode_reqs] if gens is not None and decode_reqs else None
        return _StepMetadata(fb, is_all_decode, decode_rows, decode_slots, decode_mask, extends, keys,
                             [seq_lens[i] for i in decode_reqs], packed=packed)

    def paged_decode_plan(self, fb: ForwardBatch, pool: TokenToKVPool,
                          num_heads: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a step of decode rows only whose attention our CPU kernel runs over the pool in place: the
        kernel's (slots [B, max_len], lens [B]) int64, the step planned as forward() would plan it (the decode
        stack in one C call, layers/decode_stack.py, writes the K/V and attends itself). None otherwise."""
        meta = self._metadata_for(fb)
        if not meta.is_all_decode or meta.decode_slots is None:
            return None
        if not meta.mirror_planned:
            self._plan_mirror(meta, pool, cpu_decode.pool_readable(num_heads, pool), torch.float32)
        return (meta.decode_slots, meta.lens_tensor()) if meta.paged else None

    def _plan_mirror(self, meta: _StepMetadata, pool: TokenToKVPool, kernel_reads: bool, dtype: torch.dtype) -> None:
        """Once per step, on its first layer: the kernel reads the pool (`kernel_reads`: it takes this step's
        queries), or the mirror is brought up to date."""
        meta.mirror_planned = True
        if self._mirror_layers_left:  # the previous step stopped between layers: its rows are partial
            self._mirror.clear()
        if meta.decode_rows is not None and kernel_reads:
            meta.paged = True  # no copy of the K/V needed: free the mirror's memory if an earlier step made one
            if self._mirror.k:
                self._mirror.clear()
            return
        if meta.mirror_keys is None:
            return
        req_to_token = meta.fb.req_to_token
        meta.mirror_plan = self._mirror.plan(meta.mirror_keys, meta.decode_lens,
                                             [req_to_token[row] for row, _ in meta.mirror_keys], pool, dtype)
        self._mirror_layers_left = pool.num_layers if meta.mirror_plan is not None else 0

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        fb: ForwardBatch,
        pool: TokenToKVPool,
        scaling: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        is_gqa = num_heads != k.shape[1]
        pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        meta = self._metadata_for(fb)
        if not meta.mirror_planned:
            self._plan_mirror(meta, pool, cpu_decode.reads_pool(q, pool), q.dtype)

        if meta.is_all_decode:
            return self._decode(q, k, v, pool, layer_id, meta, scaling, sliding_window)

        out = q.new_empty(num_tokens, num_heads * head_dim)
        if meta.packed is not None and pool.dtype != q.dtype:  # prefix-free keys differ from the pool's copy
            meta.extends += _causal_plans(meta.packed.members, fb.req_to_token)
            meta.packed = None
        if meta.packed is not None:
            packed_extend.attend(meta.packed, q, pool, layer_id, scaling, is_gqa, sliding_window, out)
        if meta.decode_rows is not None:
            r = meta.decode_rows
            out[r] = self._decode(q[r], k[r], v[r], pool, layer_id, meta, scaling, sliding_window)
        for i, plan in enumerate(meta.extends):
            rows = slice(plan.start, plan.start + plan.extend_len)
            mask = plan.mask if sliding_window is None else self._extend_window_mask(meta, i, sliding_window, q.device)
            if plan.slots is None:
                k_i, v_i = k[rows], v[rows]
            else:
                k_i, v_i = pool.gather(layer_id, plan.slots, q.dtype)
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1).unsqueeze(0),
                k_i.transpose(0, 1).unsqueeze(0),
                v_i.transpose(0, 1).unsqueeze(0),
                attn_mask=mask,
                is_causal=mask is None,
                scale=scaling,
                enable_gqa=is_gqa,
            )
            out[rows] = o[0].transpose(0, 1).reshape(plan.extend_len, num_heads * head_dim)
        return out

    def _decode(
        self,
        q: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        pool: TokenToKVPool,
        layer_id: int,
        meta: _StepMetadata,
        scaling: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """q: [B_dec, H, D] (one token per request) -> [B_dec, H * D], one batched call (our kernel's, or SDPA's).

        The H query heads are viewed as [num_kv_heads, group] and the group is fed to SDPA as the query
        length: every kv head serves its group without materialising repeated K/V (query head h uses kv
        head h // group, transformers' GQA convention). This runs ~2x faster on CPU than enable_gqa.
        """
        assert meta.decode_slots is not None
        batch, num_heads, head_dim = q.shape
        num_kv_heads = pool.num_kv_heads
        qg = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        if meta.paged:  # the pool in place (this step's tokens were written to it before)
            o = cpu_decode.paged_decode_attention(qg, pool, layer_id, meta.decode_slots, meta.lens_tensor(),
                                                  scaling, sliding_window)
            return o.reshape(batch, num_heads * head_dim)
        plan = meta.mirror_plan
        if plan is None:
            k, v = pool.gather(layer_id, meta.decode_slots, q.dtype)  # [B, L, Hkv, D]
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, L, D]
            mask = meta.decode_mask
            if sliding_window is not None:
                mask = self._decode_window_mask(meta, "gather", meta.decode_lens, k.shape[2], sliding_window)
            o = _decode_attention(qg, k, v, mask, scaling, meta)
            return o.reshape(batch, num_heads * head_dim)
        k, v = self._mirror.update_layer(layer_id, plan, k_new, v_new, pool)  # rows in mirror order
        self._mirror_layers_left -= 1
        if not plan.identity:  # request d sits in mirror row plan.rows[d]
            qg = torch.empty_like(qg).index_copy_(0, plan.rows, qg)
        mask = plan.mask
        if sliding_window is not None:  # rows in mirror order, whose lengths the mirror keeps
            mask = self._decode_window_mask(meta, "mirror", self._mirror.length[:batch], k.shape[2], sliding_window)
        o = _decode_attention(qg, k, v, mask, scaling, meta)
        if not plan.identity:
            o = o.index_select(0, plan.rows)
        return o.reshape(batch, num_heads * head_dim)

    @staticmethod
    def _extend_window_mask(meta: _StepMetadata, i: int, window: int, device: torch.device) -> torch.Tensor:
        """Extend request i's mask limited to the last `window` positions of each query (a key at position
        k is seen from query position p when p - window < k <= p, or as its custom mask allows within that)."""
        key = ("extend", i, window)
        if key not in meta.step_masks:
            plan = meta.extends[i]
            seq = plan.prefix_len + plan.extend_len
            q_pos = torch.arange(plan.prefix_len, seq, device=device)[:, None]
            k_pos = torch.arange(seq, device=device)[None, :]
            base = plan.mask if plan.mask is not None else k_pos <= q_pos
            meta.step_masks[key] = base & (k_pos > q_pos - window)
        return meta.step_masks[key]

    @staticmethod
    def _decode_window_mask(meta: _StepMetadata, what: str, lens: list[int], max_len: int,
                            window: int) -> torch.Tensor:
        """bool [B, 1, 1, max_len]: row b sees keys lens[b] - window .. lens[b] - 1."""
        key = (what, window)
        if key not in meta.step_masks:
            device = meta.fb.req_to_token.device
            n = torch.tensor(lens, device=device)[:, None]
            k_pos = torch.arange(max_len, device=device)[None, :]
            meta.step_masks[key] = ((k_pos < n) & (k_pos >= n - window))[:, None, None, :]
        return meta.step_masks[key]


def _causal_plans(members: list[tuple[int, int, int, int]], req_to_token: torch.Tensor) -> list[_ExtendPlan]:
    """One plan per request (start, extend_len, prefix_len, req row) without a custom mask."""
    plans = []
    for start, ext, prefix, row in members:
        seq, slots, mask = prefix + ext, None, None
        if prefix > 0:
            # Query j sits at absolute position prefix + j: it sees keys 0..prefix + j.
            slots = req_to_token[row, :seq]
            q_pos = torch.arange(prefix, seq, device=req_to_token.device)
            mask = torch.arange(seq, device=req_to_token.device)[None, :] <= q_pos[:, None]
        plans.append(_ExtendPlan(start, ext, prefix, slots, mask))
    return plans


# Below this many decode requests the CPU path keeps SDPA (one request: 31 vs 49 us per layer at demo-vl's
# shape); from here on two matmuls measured as fast on one thread and 1.5-2x faster on two.
MATMUL_DECODE_MIN_BATCH = 4


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                      scaling: float, meta: _StepMetadata) -> torch.Tensor:
    """q [B, Hkv, G, D] over k, v [B, Hkv, L, D] (mask: bool [B, 1, 1, L] or None) -> [B, Hkv, G, D].

    Why not always SDPA: torch's CPU flash kernel handles a decode step's G query rows per (request, kv head)
    poorly: at demo-vl's shape (64 requests, 2 kv heads, 2 query rows each, 100-200 keys) it read K/V at
    7-8 GB/s from the cache and got slower with a second thread (828 -> 964 us), while scores = q k^T,
    softmax, p v as three batched ops took 392-735 us on two threads. Only float32 on a CPU: in half precision
    the kernel's float32 accumulation is what transformers' numbers follow, and a GPU's kernels do well.
    """
    if not is_host(q.device) or q.dtype != torch.float32 or q.shape[0] < MATMUL_DECODE_MIN_BATCH:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scaling)
    if mask is not None:  # one additive mask per step and mask, shared by every layer
        key = ("additive", id(mask))  # the entry holds `mask`, so its id is not reused within the step
        if key not in meta.step_masks:
            meta.step_masks[key] = (mask, torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
                                    .masked_fill_(~mask, float("-inf")))
        scores.add_(meta.step_masks[key][1])
    return torch.matmul(torch.softmax(scores, dim=-1), v)
