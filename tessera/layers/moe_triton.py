"""The routed experts on CUDA: one Triton grouped GEMM per expert product over expert-sorted rows.

The (token, slot) pairs are sorted by expert and each expert's group is padded to a multiple of BLOCK_M (pad
entries point past the last pair), so every BLOCK_M-row block of the sorted list belongs to one expert; a block
table gives it. `moe_gemm_kernel` then computes, per block and BLOCK_N columns, the block's rows of A (gathered
through the sorted pair ids) times that expert's weight, and writes each row to its pair's own row of C. It runs
twice: x [T, H] (row = pair // k) @ w13[e] -> [P, 2I], the gated activation in torch, then [P, I] @ w2[e] ->
[P, H]; the k rows of each token are summed last. The routing weight multiplies the input rows as they are
loaded (Llama-4) or the output rows before they are stored (Qwen). The same plan serves any number of tokens
with no host synchronisation (the block table is sized for the worst case; blocks past the real ones exit),
so a CUDA graph can capture it. SGLang's fused_moe takes the same route.

float32 products use IEEE dot products (no TF32), as torch's matmul does by default.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl


@triton.jit
def moe_gemm_kernel(A, W, C, SortedPairs, BlockExpert, Weights, N, K, num_pairs,
                    stride_am, stride_we, stride_wk, stride_wn, stride_cm,
                    A_ROW_DIV: tl.constexpr, SCALE_A: tl.constexpr, SCALE_C: tl.constexpr, IEEE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    block = tl.program_id(0)
    expert = tl.load(BlockExpert + block)
    if expert < 0:  # past the last real block
        return
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(SortedPairs + offs_m)
    valid = pairs < num_pairs
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + a_rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = W + expert.to(tl.int64) * stride_we + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    if SCALE_A or SCALE_C:
        scale = tl.load(Weights + pairs, mask=valid, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k + k0 < K
        a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
        if SCALE_A:  # the expert's input scaled, rounded to the input's dtype (Llama-4's x * score)
            a = (a.to(tl.float32) * scale[:, None]).to(A.dtype.element_ty)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & (offs_n[None, :] < N), other=0.0)
        if IEEE:
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    if SCALE_C:
        # The product rounded to the output dtype first, then weighted: transformers' expert(x) * weight.
        acc = acc.to(C.dtype.element_ty).to(tl.float32) * scale[:, None]
    c_ptrs = C + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def block_size_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: small when experts see few rows each (decode), larger for prefill."""
    return 16 if num_pairs <= 4 * num_experts else 64


def align_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [capacity]: the pair ids (token * k + slot) sorted by expert, each expert's group padded to
    a multiple of block_m with num_pairs; block_expert [capacity // block_m]: each block's expert, -1 past the
    last), all on the device, no host sync. capacity = the worst case, P + E * (block_m - 1) rounded up."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    # Not torch.bincount: on CUDA it reads the largest id back to the host, which a CUDA graph cannot capture.
    counts = flat.new_zeros(num_experts).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    starts = counts.cumsum(0) - counts
    expert_sorted = flat[order]
    dest = padded_end[expert_sorted] - padded[expert_sorted] + torch.arange(num_pairs, device=flat.device) \
        - starts[expert_sorted]
    capacity = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    sorted_pairs = torch.full((capacity,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return sorted_pairs, block_expert


def _gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_pairs: torch.Tensor,
          block_expert: torch.Tensor, weights: torch.Tensor, a_row_div: int, scale_a: bool, scale_c: bool,
          block_m: int) -> None:
    n, k = w.shape[2], w.shape[1]
    block_n, block_k = 64, 32
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    moe_gemm_kernel[grid](a, w, out, sorted_pairs, block_expert, weights, n, k, out.shape[0],
                          a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
                          A_ROW_DIV=a_row_div, SCALE_A=scale_a, SCALE_C=scale_c, IEEE=a.dtype == torch.float32,
                          BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k)


def triton_grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                           topk_weights: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor],
                           weights_on_input: bool) -> torch.Tensor:
    """layers/moe.grouped_experts's contract (x [T, H], w13 [E, H, 2I], w2 [E, I, H]); returns [T, H]."""
    if x.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    block_m = block_size_m(num_pairs, w13.shape[0])
    sorted_pairs, block_expert = align_blocks(topk_ids, w13.shape[0], block_m)
    weights = topk_weights.reshape(-1).contiguous()
    gate_up = x.new_empty(num_pairs, w13.shape[2])
    _gemm(x, w13, gate_up, sorted_pairs, block_expert, weights, top_k, weights_on_input, False, block_m)
    hidden = act(gate_up).contiguous()
    down = x.new_empty(num_pairs, w2.shape[2])
    _gemm(hidden, w2, down, sorted_pairs, block_expert, weights, 1, False, not weights_on_input, block_m)
    return down.view(num_tokens, top_k, -1).sum(dim=1)
