"""The LoRA products as Triton kernels (CUDA; on a CPU only under TRITON_INTERPRET=1, where the tests run them):
each token row takes its own adapter's A and B from the slot stacks (Punica's BGMV: a gathered matrix-vector
product per row, every adapter of the batch in one launch, no grouping on the host).

- `lora_shrink(x, A, row_slots)`: xa[t] = A[slot_t] @ x[t] ([T, SR], float32); rows with slot -1 get zeros;
- `lora_expand(y, xa, Bt, row_slots)`: y[t] += xa[t] @ Bt[slot_t], in place, in y's dtype (rows with slot -1
  untouched).

The stacks are the LoraSlots' own ([slots, SR, in] and [slots, SR, out], B transposed), so a merged linear's
block-diagonal B is one expand. Sums are in float32 whatever the dtype. The launch depends on no host value of
the step (the row slots are a device tensor), so a captured CUDA graph replays it with other adapters.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def lora_shrink_kernel(X, A, XA, SLOTS, K, R, stride_x, stride_as, stride_ar, stride_xa,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(SLOTS + row)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    if slot >= 0:
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            x = tl.load(X + row * stride_x + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            a = tl.load(A + slot * stride_as + offs_r[:, None] * stride_ar + offs_k[None, :],
                        mask=mask_r[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], 1)
    tl.store(XA + row * stride_xa + offs_r, acc, mask=mask_r)


@triton.jit
def lora_expand_kernel(Y, XA, BT, SLOTS, N, R, stride_y, stride_xa, stride_bs, stride_br,
                       BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(SLOTS + row)
    if slot >= 0:
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        offs_r = tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        xa = tl.load(XA + row * stride_xa + offs_r, mask=mask_r, other=0.0)
        b = tl.load(BT + slot * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :],
                    mask=mask_r[:, None] & mask_n[None, :], other=0.0).to(tl.float32)
        delta = tl.sum(xa[:, None] * b, 0)
        y = tl.load(Y + row * stride_y + offs_n, mask=mask_n, other=0.0)
        tl.store(Y + row * stride_y + offs_n, (y.to(tl.float32) + delta).to(y.dtype), mask=mask_n)


def _block(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def lora_shrink(x: torch.Tensor, A: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
    """x [T, K] (rows contiguous), A [slots, R, K] contiguous, row_slots [T] int64 -> xa [T, R] float32."""
    t, k = x.shape
    r = A.shape[1]
    assert x.stride(1) == 1 and A.is_contiguous() and A.shape[2] == k
    xa = torch.empty(t, r, dtype=torch.float32, device=x.device)
    block_r = _block(r)
    lora_shrink_kernel[(t,)](x, A, xa, row_slots, k, r, x.stride(0), A.stride(0), A.stride(1), xa.stride(0),
                             BLOCK_R=block_r, BLOCK_K=max(16, min(128, 4096 // block_r)))
    return xa


def lora_expand(y: torch.Tensor, xa: torch.Tensor, Bt: torch.Tensor, row_slots: torch.Tensor) -> torch.Tensor:
    """y [T, N] += xa [T, R] @ Bt[slot] ([slots, R, N] contiguous) per row, in place; returns y."""
    t, n = y.shape
    r = Bt.shape[1]
    assert y.stride(1) == 1 and Bt.is_contiguous() and Bt.shape[2] == n and xa.is_contiguous()
    block_r = _block(r)
    block_n = max(16, min(256, 8192 // block_r))
    lora_expand_kernel[(t, triton.cdiv(n, block_n))](y, xa, Bt, row_slots, n, r, y.stride(0), xa.stride(0),
                                                     Bt.stride(0), Bt.stride(1), BLOCK_R=block_r, BLOCK_N=block_n)
    return y
