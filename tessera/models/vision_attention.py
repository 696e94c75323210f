"""Vision-tower attention over every image of a call at once, for transformers' Qwen-VL towers.

transformers' Qwen2-VL / Qwen2.5-VL / Qwen3-VL vision attention (without flash-attn) splits q/k/v at
`cu_seqlens` and makes one SDPA call per image (per window in Qwen2.5-VL's windowed blocks) per block.
`VarlenVisionAttention` replaces it with the same parameters (`qkv`, `proj`, so checkpoints load unchanged):

- CUDA, fp16/bf16: ONE varlen flash-attention call over all segments (torch's `varlen_attn`, torch >= 2.9,
  else flash-attn's `flash_attn_varlen_func` when installed).
- CPU (and CUDA fp32, or neither kernel available): consecutive segments of equal length run as one
  batched SDPA call [n, heads, L, head_dim] on views of the packed tensors (callers put equal-length items
  next to each other). A single call with a block-diagonal mask was measured and is several times slower on
  a CPU (its flash kernel does not skip masked blocks): see docs/benchmarks.md, "Vision tower".

The 2D rotary embedding is applied to q and k together with in-place multiply-adds (transformers builds
rotate_half with a cat and four temporaries per tensor).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tessera.platform import cpu_kernels
from tessera.platform.device import is_host, platform_of
from tessera.layers.rotary import rotary_kernel


@dataclass(frozen=True)
class SegmentPlan:
    """How one `cu_seqlens` is cut into batched attention calls (built once per tower call, shared by blocks).

    calls: (first token, number of segments, segment length) of each SDPA call: consecutive segments of equal
    length, at most `CPU_TOKENS_PER_CALL` tokens per call on a CPU.
    """

    cu_seqlens: torch.Tensor  # [num_segments + 1] int32 on the tensors' device (for the varlen kernels)
    max_len: int
    calls: tuple[tuple[int, int, int], ...]


# On a CPU one SDPA call over many short segments ([256, heads, 64, head_dim]: Qwen2.5-VL's windows) was 1.4x
# slower than calls of ~16 segments, whose inputs and output stay in the cache; images of 200-300 tokens
# gained little from any batching. Measured on demo-vl's shapes (4 heads of 32), one thread.
CPU_TOKENS_PER_CALL = 2048


def plan_segments(cu_seqlens: torch.Tensor) -> SegmentPlan:
    """The calls for segments [cu[i], cu[i+1]). Only consecutive segments are batched: gathering equal
    lengths from across the batch into one call was measured 2x slower on a CPU (the copies cost more than
    the calls they save), so callers that want big batches put equal-length items next to each other."""
    bounds = cu_seqlens.tolist()  # one host read per tower call and cu_seqlens (cached by PlanCache)
    cap = CPU_TOKENS_PER_CALL if is_host(cu_seqlens.device) else 1 << 62
    calls: list[tuple[int, int, int]] = []
    for start, end in zip(bounds, bounds[1:]):
        seg_len = end - start
        if seg_len == 0:
            continue
        if calls and calls[-1][2] == seg_len and (calls[-1][1] + 1) * seg_len <= cap:
            first, count, _ = calls[-1]
            calls[-1] = (first, count + 1, seg_len)
        else:
            calls.append((start, 1, seg_len))
    max_len = max((b - a for a, b in zip(bounds, bounds[1:])), default=0)
    return SegmentPlan(cu_seqlens.to(torch.int32), max_len, tuple(calls))


class PlanCache:
    """The plan of the last few cu_seqlens tensors seen, matched by identity: a tower passes the same tensor
    to every block (Qwen2.5-VL alternates two), so the host read happens once per tower call. Holding the
    tensor keeps its identity from being reused by another."""

    def __init__(self, size: int = 2) -> None:
        self.size = size
        self.entries: list[tuple[torch.Tensor, SegmentPlan]] = []

    def get(self, cu_seqlens: torch.Tensor) -> SegmentPlan:
        for tensor, plan in self.entries:
            if tensor is cu_seqlens:
                return plan
        plan = plan_segments(cu_seqlens)
        self.entries = [(cu_seqlens, plan), *self.entries[: self.size - 1]]
        return plan


@functools.cache
def _cuda_varlen_kernel():
    """torch's varlen_attn (torch >= 2.9), else flash-attn's varlen function, else None. Both take packed
    [tokens, heads, head_dim] q/k/v, int32 cu_seqlens and the max length, fp16/bf16 only."""
    try:
        from torch.nn.attention.varlen import varlen_attn

        # Positional arguments only: the keyword set changed between torch releases; the default scale
        # (head_dim ** -0.5) is the towers' scale.
        return lambda q, k, v, cu, max_len: varlen_attn(q, k, v, cu, cu, max_len, max_len)
    except ImportError:
        pass
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return lambda q, k, v, cu, max_len: flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len)


def uses_varlen_kernel(q: torch.Tensor) -> bool:
    return (platform_of(q.device).varlen_attention and q.dtype in (torch.float16, torch.bfloat16)
            and _cuda_varlen_kernel() is not None)


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SegmentPlan,
                      scale: float) -> torch.Tensor:
    """q, k, v: [tokens, heads, head_dim] (any strides) -> [tokens, heads, head_dim]; tokens attend within
    their segment only. One SDPA call per entry of plan.calls, with as few ops around each as possible
    (Qwen2.5-VL's windows make hundreds of calls per block)."""
    heads, head_dim = q.shape[1:]
    sizes = [count * seg_len for _, count, seg_len in plan.calls]
    # [tokens, H, D] -> [H, tokens, D] views, cut at the calls: [H, count * L, D] each.
    pieces = zip(*(t.transpose(0, 1).split(sizes, dim=1) for t in (q, k, v)))
    outs = []
    for (q_r, k_r, v_r), (_, count, seg_len) in zip(pieces, plan.calls):
        if count == 1:
            res = F.scaled_dot_product_attention(q_r[None], k_r[None], v_r[None], scale=scale)
        else:
            shape = (heads, count, seg_len, head_dim)
            res = F.scaled_dot_product_attention(q_r.view(shape).transpose(0, 1), k_r.view(shape).transpose(0, 1),
                                                 v_r.view(shape).transpose(0, 1), scale=scale)
        # [count, H, L, D] -> [count * L, H, D]: a view where SDPA's output is laid out [count, L, H, D]
        # (CPU flash attention), else a copy.
        outs.append(res.transpose(1, 2).reshape(-1, heads, head_dim))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: SegmentPlan,
                      scale: float) -> torch.Tensor:
    """Bidirectional attention within each segment of `plan`: one varlen kernel call on CUDA (fp16/bf16),
    batched SDPA calls per segment length otherwise."""
    if uses_varlen_kernel(q) and abs(scale - q.shape[-1] ** -0.5) < 1e-12:
        kernel = _cuda_varlen_kernel()
        return kernel(q.contiguous(), k.contiguous(), v.contiguous(), plan.cu_seqlens, plan.max_len)
    return grouped_attention(q, k, v, plan, scale)


class VarlenVisionAttention(torch.nn.Module):
    """Qwen-VL vision attention: fused `qkv` and `proj` linears, 2D rotary on q and k, attention within each
    cu_seqlens segment. A drop-in for transformers' modules (`replacing`: same parameters, same forward
    signature: packed hidden states [tokens, dim], cu_seqlens, (cos, sin) [tokens, head_dim])."""

    def __init__(self, qkv: torch.nn.Module, proj: torch.nn.Module, num_heads: int, head_dim: int, scaling: float,
                 plans: PlanCache) -> None:
        super().__init__()
        self.qkv, self.proj = qkv, proj
        self.num_heads, self.head_dim, self.scaling = int(num_heads), int(head_dim), float(scaling)
        self.plans = plans  # shared by a tower's blocks

    @classmethod
    def replacing(cls, original: torch.nn.Module, plans: PlanCache) -> VarlenVisionAttention:
        """The same attention over transformers' module's own `qkv` / `proj` parameters."""
        return cls(original.qkv, original.proj, original.num_heads, original.head_dim, original.scaling, plans)

    def forward(self, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None, **kwargs) -> torch.Tensor:
        num_tokens = hidden_states.shape[0]
        qkv = self.qkv(hidden_states).view(num_tokens, 3, self.num_heads, self.head_dim)
        assert position_embeddings is not None, "Qwen-VL towers always pass (cos, sin)"
        qk = rotate_qk(qkv[:, :2], *position_embeddings)
        out = segment_attention(qk[:, 0], qk[:, 1], qkv[:, 2], self.plans.get(cu_seqlens), self.scaling)
        return self.proj(out.reshape(num_tokens, -1))


def rotate_qk(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb_vision on q and k at once. qk: [tokens, 2, heads, head_dim];
    cos, sin: [tokens, head_dim]. x*cos + rotate_half(x)*sin with rotate_half(x) = cat(-x2, x1), computed
    in fp32 like transformers, written as two in-place multiply-adds on the halves."""
    dtype = qk.dtype
    half = qk.shape[-1] // 2
    # The towers repeat their angles over both halves (checked: ~50 us against ~15 ms of torch's form per block
    # over demo-vl's 64 images): then the decoder's one-pass kernel takes q and k as 2 x heads heads.
    if (cpu_kernels.takes("rotary") and cpu_kernels.host_f32_inference(qk, contiguous=False)
            and torch.equal(cos[:, :half], cos[:, half:])
            and torch.equal(sin[:, :half], sin[:, half:])):
        out = rotary_kernel(qk.flatten(1, 2), cos[:, :half], sin[:, :half])
        if out is not None:
            return out.view(qk.shape)
    x = qk.float()
    cos, sin = cos.float()[:, None, None, :], sin.float()[:, None, None, :]
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1.0)
    out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return out.to(dtype)
