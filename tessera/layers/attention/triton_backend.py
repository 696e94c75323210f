"""`--attention-backend triton`: paged attention with our Triton kernels (triton_kernels.py).

Per step (init_forward_metadata, shared by all layers): the per-request rows, lengths and extend starts as
int32 device tensors, and the custom masks flattened into one buffer with per-request offsets. Per layer:
the new K/V go into the pool, then one kernel launch: decode when every request adds one token without a
custom mask, extend otherwise (decode requests are extends of length 1 there).

A decode-only batch (ForwardBatch.decode_only, the CUDA-graph runner's) is planned from its device tensors
alone: the decode kernel reads each request's length and row on the device, so one captured launch serves
any lengths (feature "cuda_graph").

Split-KV decode: one program per (request, head) leaves a GPU mostly idle when requests x heads is far below
its SM count (batch 1 of a 28-head model on a 132-SM H200: 28 programs, each walking the whole context). Then
each request's keys are cut into NUM_SPLITS runs (a power of two, from the batch and head count alone, so a
captured graph keeps one plan for any lengths) and a second kernel combines the runs' partial softmaxes; a
short context leaves the later runs empty. Larger batches keep the one-kernel decode.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from tessera.cache.kv_pool import TokenToKVPool
from tessera.layers.attention.base import BaseAttentionBackend
from tessera.layers.forward_batch import ForwardBatch
from tessera.platform.device import platform_of

BLOCK_M = 32  # queries per extend program
BLOCK_N = 32  # keys per inner step
# Rows of q/k/v wider than this many bytes (float32 heads of 512: Gemma 4's full layers) halve the extend kernel's
# blocks: 32 x 32 of them took 196 KiB of shared memory, over sm_80's 163 KiB (tessera/bench/gpu_compile.py).
WIDE_ROW_BYTES = 1024
MAX_SPLITS = 16  # split-KV decode: at most this many runs of a request's keys
PROGRAMS_PER_UNIT = 2  # split until requests x heads x splits reaches this many programs per SM
# Where the device does not say (Triton's interpreter, which runs programs one after another): small batches still
# split, into few runs; 32 gave 16 runs at batch 1, most of them empty, and tripled the interpreted model tests.
UNKNOWN_UNITS = 8


@dataclass
class _Meta:
    fb: ForwardBatch
    rows: torch.Tensor  # [B] int32 req_to_token rows
    seq_lens: torch.Tensor  # [B] int32
    ext_lens: torch.Tensor  # [B] int32
    ext_starts: torch.Tensor  # [B] int32 first flat row of each request
    masks: torch.Tensor  # flattened uint8 custom masks (a 1-element dummy when there are none)
    mask_indptr: torch.Tensor  # [B] int64 offset of each request's mask in `masks`, -1 = causal
    max_ext: int
    all_decode: bool


class TritonAttentionBackend(BaseAttentionBackend):
    features = BaseAttentionBackend.features | {"cuda_graph"}
    reads_new_kv_from_pool = True

    def __init__(self) -> None:
        self._meta: _Meta | None = None
        self._units: dict[torch.device, int] = {}  # the device's SM count, asked once

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        self._meta = self._build(fb)

    split_kv = True  # False: always the one-kernel decode

    def kv_splits(self, batch: int, heads: int, device: torch.device) -> int:
        """Runs per request's keys for a decode step of `batch` requests (1: no split)."""
        if not self.split_kv:
            return 1
        units = self._units.get(device)
        if units is None:
            units = self._units[device] = platform_of(device).parallel_units(device) or UNKNOWN_UNITS
        want = -(-PROGRAMS_PER_UNIT * units // (batch * heads))
        return 1 if want < 2 else min(MAX_SPLITS, triton.next_power_of_2(want))

    @staticmethod
    def _build(fb: ForwardBatch) -> _Meta:
        device = fb.req_to_token.device
        if fb.decode_only:  # no host values and no host-to-device copy: capturable in a CUDA graph
            none = torch.empty(0, dtype=torch.int32, device=device)
            return _Meta(fb, fb.req_pool_indices, fb.seq_lens, none, none, none, none, 1, True)
        ext, seq, starts, rows = fb.host_plan()
        masks = fb.custom_masks or [None] * len(seq)
        parts, indptr, offset = [], [], 0
        for m in masks:
            if m is None:
                indptr.append(-1)
            else:
                parts.append(m.to(device=device, dtype=torch.uint8).reshape(-1))
                indptr.append(offset)
                offset += parts[-1].numel()
        flat = torch.cat(parts) if parts else torch.zeros(1, dtype=torch.uint8, device=device)

        def ints(values: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        return _Meta(fb, ints(rows), ints(seq), ints(ext), ints(starts), flat, ints(indptr, torch.int64),
                     max(ext, default=0), all(e == 1 for e in ext) and not parts)

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int, fb: ForwardBatch,
                pool: TokenToKVPool, scaling: float, sliding_window: int | None = None) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        if k is not None and v is not None:
            pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        meta = self._meta if self._meta is not None and self._meta.fb is fb else self._build(fb)
        self._meta = meta
        k_buf, v_buf = pool.get_kv(layer_id)
        q = q.contiguous()
        out = torch.empty_like(q)
        group = num_heads // pool.num_kv_heads
        block_d = triton.next_power_of_2(max(head_dim, 16))
        window = sliding_window or 0
        r2t = fb.req_to_token
        splits = self.kv_splits(num_tokens, num_heads, q.device) if meta.all_decode else 1
        if splits > 1:
            part_acc = torch.empty((num_tokens, num_heads, splits, block_d), dtype=torch.float32, device=q.device)
            part_ml = torch.empty((num_tokens, num_heads, splits, 2), dtype=torch.float32, device=q.device)
            decode_split_kernel[(num_tokens, num_heads, splits)](
                q, k_buf, v_buf, part_acc, part_ml, r2t, meta.rows, meta.seq_lens, scaling, window, group,
                q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), r2t.stride(0), HEAD_DIM=head_dim,
                BLOCK_D=block_d, BLOCK_N=BLOCK_N, NUM_SPLITS=splits)
            decode_reduce_kernel[(num_tokens, num_heads)](part_acc, part_ml, out, out.stride(0), out.stride(1),
                                                         HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits)
        elif meta.all_decode:
            decode_kernel[(num_tokens, num_heads)](
                q, k_buf, v_buf, out, r2t, meta.rows, meta.seq_lens, scaling, window, group,
                q.stride(0), q.stride(1), k_buf.stride(0), k_buf.stride(1), out.stride(0), out.stride(1),
                r2t.stride(0), HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=BLOCK_N)
        else:
            wide = block_d * q.element_size() > WIDE_ROW_BYTES
            block_m, block_n = (BLOCK_M // 2, BLOCK_N // 2) if wide else (BLOCK_M, BLOCK_N)
            grid = (meta.rows.shape[0], num_heads, triton.cdiv(meta.max_ext, block_m))
            extend_kernel[grid](
                q, k_buf, v_buf, out, r2t, meta.rows, meta.seq_lens, meta.ext_lens, meta.ext_starts, meta.masks,
                meta.mask_indptr, scaling, window, group, q.stride(0), q.stride(1), k_buf.stride(0),
                k_buf.stride(1), out.stride(0), out.stride(1), r2t.stride(0), HEAD_DIM=head_dim, BLOCK_D=block_d,
                BLOCK_M=block_m, BLOCK_N=block_n, IEEE=q.dtype == torch.float32)
        return out.reshape(num_tokens, num_heads * head_dim)


from tessera.layers.attention.triton_kernels import (  # noqa: E402  (after triton)
    decode_kernel,
    decode_reduce_kernel,
    decode_split_kernel,
    extend_kernel,
)
