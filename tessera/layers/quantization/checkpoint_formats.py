"""Pre-quantized checkpoints' stored forms of one linear weight -> AffineWeight (or, for fp8, the float weight).

The layouts, as the tools that write them define them:
- AWQ GEMM (AutoAWQ's WQLinear_GEMM): qweight int32 [in, out / 8], eight 4-bit values per word along the
  output dim in the order 0, 2, 4, 6, 1, 3, 5, 7; qzeros int32 [groups, out / 8] packed the same way;
  scales [groups, out]. w = (q - z) * s.
- GPTQ (AutoGPTQ / optimum / GPTQModel): qweight int32 [in * bits / 32, out] packed along the input dim,
  value j of a word at bits [j * bits, (j + 1) * bits); qzeros int32 [groups, out * bits / 32] packed along
  the output dim; scales [groups, out]; g_idx [in] the group of each input column. The original ("gptq",
  v1) format stores zero - 1 (so a zero of 0 reads back as 2**bits, as every v1 reader computes it);
  "gptq_v2" stores the zero itself.
- compressed-tensors pack-quantized: weight_packed int32 [out, ceil(in * bits / 32)], consecutive input
  values from bit 0 up, each stored as its signed value + 2**(bits - 1); weight_scale [out, groups];
  weight_zero_point (asymmetric only) signed, packed the same way along the output dim (int8 unpacked in
  older releases); weight_shape [out, in]. naive-quantized: the signed int8 weight itself.
- fp8 (compressed-tensors float-quantized, HF's fp8): a float8_e4m3fn weight times a per-tensor,
  per-row or per-block scale.
"""

from __future__ import annotations

import torch

from tessera.layers.quantization.affine import AffineWeight

# Position in an AWQ word of each of 8 consecutive output columns (the inverse of AWQ's packing order).
AWQ_UNPACK_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def _owned(t: torch.Tensor) -> torch.Tensor:
    """A float32 copy: a checkpoint tensor may share the storage of the whole memory-mapped file, and a scale
    kept as a view of it would keep every page of the file resident while the model lives."""
    return t.to(torch.float32, copy=True).contiguous()


class CheckpointFormatError(ValueError):
    """A quantized module's stored tensors are inconsistent with each other or with the config."""


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32 / bits unsigned values (int32), consecutive along `dim` (0 or 1), value j of a
    word at bits [j * bits, (j + 1) * bits)."""
    if packed.dtype != torch.int32:
        raise CheckpointFormatError(f"packed tensor is {packed.dtype}, want torch.int32")
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C, per]
    rows, cols = packed.shape
    if dim == 1:
        return values.reshape(rows, cols * per)
    return values.permute(0, 2, 1).reshape(rows * per, cols)


def _group_size(in_features: int, groups: int, name: str) -> int:
    if groups <= 0 or in_features % groups:
        raise CheckpointFormatError(f"{name}: {groups} scale groups do not divide {in_features} input features")
    return in_features // groups


def awq_gemm(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> AffineWeight:
    """AWQ GEMM's qweight [in, out / 8], qzeros [groups, out / 8], scales [groups, out] (4-bit)."""
    inp, out = qweight.shape[0], qweight.shape[1] * 8
    if tuple(scales.shape) != (qzeros.shape[0], out) or qzeros.shape[1] * 8 != out:
        raise CheckpointFormatError(f"awq: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                                    f"scales {tuple(scales.shape)} do not agree")
    order = list(AWQ_UNPACK_ORDER)

    def natural(packed: torch.Tensor) -> torch.Tensor:
        values = unpack_int32(packed, 4, dim=1)
        return values.view(values.shape[0], -1, 8)[:, :, order].reshape(values.shape[0], -1)

    q, z = natural(qweight), natural(qzeros)
    group = _group_size(inp, scales.shape[0], "awq")
    return AffineWeight(q.t().to(torch.uint8).contiguous(), _owned(scales.t()), _owned(z.t()),
                        4, group)


def gptq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
         bits: int, v2: bool) -> AffineWeight:
    """GPTQ's qweight [in * bits / 32, out], qzeros [groups, out * bits / 32], scales [groups, out], g_idx [in]
    (None, or the trivial map i -> i // group_size: act-order checkpoints are refused by the config)."""
    q = unpack_int32(qweight, bits, dim=0)  # [in, out]
    z = unpack_int32(qzeros, bits, dim=1)[:, : scales.shape[1]]
    inp, out = q.shape
    if tuple(scales.shape) != (z.shape[0], out):
        raise CheckpointFormatError(f"gptq: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                                    f"scales {tuple(scales.shape)} do not agree")
    group = _group_size(inp, scales.shape[0], "gptq")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(inp) // group):
        raise CheckpointFormatError("gptq: g_idx is not i // group_size (an act-order checkpoint: desc_act true)")
    zero = z.float() if v2 else z.float() + 1
    return AffineWeight(q.t().to(torch.uint8).contiguous(), _owned(scales.t()), zero.t().contiguous(),
                        bits, group)


def ct_pack_quantized(weight_packed: torch.Tensor, weight_scale: torch.Tensor, weight_shape: torch.Tensor,
                      weight_zero_point: torch.Tensor | None, bits: int) -> AffineWeight:
    """compressed-tensors pack-quantized (W4A16 / W8A16, symmetric or with zero points)."""
    out, inp = (int(x) for x in weight_shape.tolist())
    q = unpack_int32(weight_packed, bits, dim=1)[:, :inp]
    offset = 1 << (bits - 1)
    scale = _owned(weight_scale).reshape(out, -1)
    zero = _ct_zero(weight_zero_point, bits, out, scale.shape[1], offset)
    if tuple(q.shape) != (out, inp):
        raise CheckpointFormatError(f"compressed-tensors: weight_packed {tuple(weight_packed.shape)} does not hold "
                                    f"weight_shape {(out, inp)}")
    return AffineWeight(q.to(torch.uint8).contiguous(), scale.contiguous(), zero,
                        bits, _group_size(inp, scale.shape[1], "compressed-tensors"))


def ct_naive_int8(weight: torch.Tensor, weight_scale: torch.Tensor,
                  weight_zero_point: torch.Tensor | None) -> AffineWeight:
    """compressed-tensors naive-quantized int8: the signed weight [out, in], scale [out, groups] (or one)."""
    out, inp = weight.shape
    scale = _owned(weight_scale.reshape(-1, 1).expand(out, 1) if weight_scale.numel() == 1 else
                   weight_scale.reshape(out, -1))
    zero = _ct_zero(weight_zero_point, 8, out, scale.shape[1], 128)
    q = (weight.to(torch.int16) + 128).to(torch.uint8)
    return AffineWeight(q, scale.contiguous(), zero, 8, _group_size(inp, scale.shape[1], "compressed-tensors"))


def _ct_zero(zero_point: torch.Tensor | None, bits: int, out: int, groups: int, offset: int) -> torch.Tensor:
    """Zero points in q's unsigned units: the offset itself when symmetric (none stored)."""
    if zero_point is None:
        return torch.full((out, groups), float(offset))
    if zero_point.dtype == torch.int32:  # packed along the output dim, offset like the weight
        return unpack_int32(zero_point, bits, dim=0)[:out].float().reshape(out, groups).contiguous()
    return (zero_point.float() + offset).reshape(out, groups).contiguous()


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An fp8 weight [out, in] times its scale: one value, one per row ([out, 1]), or one per block
    ([ceil(out / rows), ceil(in / cols)], `block` = (rows, cols))."""
    if weight.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise CheckpointFormatError(f"fp8 weight is {weight.dtype}")
    w, s = weight.float(), scale.float()
    out, inp = w.shape
    if s.numel() == 1:
        return (w * s.reshape(())).to(dtype)
    if s.shape == (out, 1) or s.shape == (out,):
        return (w * s.reshape(out, 1)).to(dtype)
    if block is None or s.dim() != 2 or s.shape != (-(-out // block[0]), -(-inp // block[1])):
        raise CheckpointFormatError(f"fp8 scale {tuple(s.shape)} fits neither the weight {(out, inp)} "
                                    f"nor its blocks {block}")
    full = s.repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)[:, :inp]
    return (w * full).to(dtype)
