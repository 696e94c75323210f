"""AffineWeight: one quantized linear weight in the form every source produces and every kernel packs from.

Sources differ in how they store a quantized weight (AWQ packs eight 4-bit values into an int32 along the
output dim, GPTQ along the input dim, compressed-tensors along the input dim with signed values, torchao
quantizes a float tensor). Kernels differ in what they read (an int8 row-major matrix, torch's int4 tile
layout, our C kernels' layout). Between the two sits one unpacked form, so that each source and each kernel
is written once: w[o, i] = (q[o, i] - zero[o, i // g]) * scale[o, i // g].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AffineWeight:
    """q: uint8 [out, in], values in [0, 2**bits); scale, zero: float32 [out, in // group_size] (one column
    when group_size equals in_features: per channel). zero is in q's units and may be fractional (torchao's
    int4 keeps a float zero point); a symmetric int8 weight has zero 128 everywhere."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int

    def __post_init__(self) -> None:
        out, inp = self.q.shape
        if self.q.dtype != torch.uint8 or self.bits not in (4, 8):
            raise ValueError(f"q must be uint8 with 4 or 8 bits, got {self.q.dtype} and {self.bits} bits")
        if self.group_size <= 0 or inp % self.group_size:
            raise ValueError(f"group_size {self.group_size} does not divide in_features {inp}")
        groups = (out, inp // self.group_size)
        if tuple(self.scale.shape) != groups or tuple(self.zero.shape) != groups:
            raise ValueError(f"scale {tuple(self.scale.shape)} / zero {tuple(self.zero.shape)}, want {groups}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def symmetric(self) -> bool:
        return bool((self.zero == float(1 << (self.bits - 1))).all())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [out, in] this stands for (the always-correct path, and the tests' reference)."""
        scale = self.scale.repeat_interleave(self.group_size, dim=1)
        zero = self.zero.repeat_interleave(self.group_size, dim=1)
        return ((self.q.float() - zero) * scale).to(dtype)

    def rows(self, start: int, length: int) -> AffineWeight:
        """Output rows [start, start + length) (a column-parallel shard, or one of a merged projection's)."""
        return AffineWeight(self.q.narrow(0, start, length), self.scale.narrow(0, start, length),
                            self.zero.narrow(0, start, length), self.bits, self.group_size)

    def columns(self, start: int, length: int) -> AffineWeight:
        """Input columns [start, start + length) (a row-parallel shard); must fall on group boundaries."""
        if start % self.group_size or length % self.group_size:
            raise ValueError(f"columns [{start}, {start + length}) split groups of {self.group_size}")
        g0, gn = start // self.group_size, length // self.group_size
        return AffineWeight(self.q.narrow(1, start, length), self.scale.narrow(1, g0, gn),
                            self.zero.narrow(1, g0, gn), self.bits, self.group_size)

    @staticmethod
    def cat_rows(parts: list[AffineWeight]) -> AffineWeight:
        """Stacks shards along the output dim (q, k, v into one qkv weight); bits and groups must agree."""
        first = parts[0]
        if any(p.bits != first.bits or p.group_size != first.group_size for p in parts):
            raise ValueError("shards of one merged projection must share bits and group size")
        return AffineWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                            torch.cat([p.zero for p in parts]), first.bits, first.group_size)


def quantize(weight: torch.Tensor, bits: int, group_size: int | None = None,
             symmetric: bool = False) -> AffineWeight:
    """Round-to-nearest quantization of a float weight [out, in] (group_size None: per output channel).
    Asymmetric: each group's [min, max] maps onto [0, 2**bits - 1] with a float zero point (torchao's int4
    weight-only scheme); symmetric: max |w| maps onto 2**(bits-1) - 1 around the zero 2**(bits-1)."""
    w = weight.detach().float()
    out, inp = w.shape
    group = group_size or inp
    if inp % group:
        raise ValueError(f"group_size {group} does not divide in_features {inp}")
    g = w.reshape(out, inp // group, group)
    top = (1 << bits) - 1
    if symmetric:
        mid = 1 << (bits - 1)
        scale = (g.abs().amax(-1) / (mid - 1)).clamp_min(1e-12)
        zero = torch.full_like(scale, float(mid))
    else:
        lo, hi = g.amin(-1).clamp_max(0), g.amax(-1).clamp_min(0)
        scale = ((hi - lo) / top).clamp_min(1e-12)
        zero = -lo / scale
    q = torch.round(g / scale[..., None] + zero[..., None]).clamp_(0, top)
    return AffineWeight(q.to(torch.uint8).reshape(out, inp), scale, zero, bits, group)
