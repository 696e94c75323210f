"""RMSNorm with an optional fused residual add."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera.layers import fused
from tessera.platform import cpu_kernels


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)), normalised in float32 and cast back before the weight
    multiply (the order transformers' Qwen2/Llama RMSNorm uses, so results match bit for bit in float32).

    forward(x) -> y; forward(x, residual) -> (norm(x + residual), x + residual): the sum is the next
    residual, which saves the decoder layer one add and one tensor.

    Float32 inference on a CPU over [tokens, hidden] goes through our C kernel (cpu_rmsnorm.c) where it is
    built: torch's CPU path is about ten operators per call, and a decode step is bound by such overheads
    (figures: docs/benchmarks.md, "C kernels for few-row products and RMSNorm"). Its sum of squares runs in
    another order, so it matches transformers to ~1e-6, not bit for bit; the residual sum is the same single add.
    """

    fused_kind = "rms"  # what layers/triton_ops.py's kernels compute for it (a q/k norm in the rotary kernel)

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One call for the same float32 ops (bit-identical to the lines below, tested): a small model's decode
            # step is bound by per-op overhead (docs/benchmarks.md, "RMSNorm in float32 is one F.rms_norm call").
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if fused.active(x):  # one Triton kernel for the add and the norm (layers/triton_ops.py)
            out = fused.ops().rmsnorm(x, residual, self.weight, self.eps)
            if out is not None:
                return out
        if _kernel_applies(x, residual, self.weight):
            return _cpu_rmsnorm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


def _kernel_applies(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """[tokens, hidden] operands the CPU kernels take (cpu_kernels.takes); anything else: torch."""
    return (x.dim() == 2 and weight.shape == x.shape[1:] and (residual is None or residual.shape == x.shape)
            and cpu_kernels.takes("rmsnorm", x, residual, weight))


def _cpu_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else None
    cpu_kernels.call("rmsnorm", x.data_ptr(), None if residual is None else residual.data_ptr(),
                     None if summed is None else summed.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0],
                     x.shape[1], eps, torch.get_num_threads())
    return out if residual is None else (out, summed)
