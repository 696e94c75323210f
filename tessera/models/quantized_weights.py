"""A pre-quantized checkpoint's tensors, grouped per linear module and turned into one weight each.

The weight loader reads `<module>.weight` for every linear. A quantized checkpoint stores instead several
tensors per module (`<module>.qweight/.qzeros/.scales`, `<module>.weight_packed/.weight_scale/...`). This
stream buffers them until a module's set is complete and yields `<module>.weight` as an AffineWeight (fp8:
as the dequantized float weight); every other tensor passes through as it comes. The loader then either
dequantizes the AffineWeight into the float parameter, or (once the linears take quantized weights) hands
it over; name mapping, merged shards and the missing/unexpected checks stay the loader's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from tessera.layers.quantization import checkpoint_formats as fmt
from tessera.layers.quantization.affine import AffineWeight
from tessera.models.quant_config import QuantConfig

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class _Parts:
    """The tensors of one quantized module: `required` complete it; `optional` are taken when present."""

    required: frozenset[str]
    optional: frozenset[str] = frozenset()


def _parts(quant: QuantConfig) -> _Parts:
    zp = frozenset() if quant.symmetric else frozenset({"weight_zero_point"})
    if quant.method in ("awq", "gptq"):
        return _Parts(frozenset({"qweight", "qzeros", "scales"}), frozenset({"g_idx"} if quant.method == "gptq" else ()))
    if quant.format == "pack-quantized":
        return _Parts(frozenset({"weight_packed", "weight_scale", "weight_shape"}) | zp)
    if quant.format == "naive-quantized":
        return _Parts(frozenset({"weight", "weight_scale"}) | zp)
    if quant.format == "fp8-block":
        return _Parts(frozenset({"weight", "weight_scale_inv"}))
    return _Parts(frozenset({"weight", "weight_scale"}))  # float-quantized


class QuantizedCheckpoint:
    """Wraps a checkpoint's (name, tensor) stream; see the module docstring."""

    def __init__(self, quant: QuantConfig):
        self.quant = quant
        self.parts = _parts(quant)
        self.names = self.parts.required | self.parts.optional
        self.dequantized: set[str] = set()  # fp8 weights, yielded already as float: `<module>.weight` names

    def _is_part(self, suffix: str, tensor: torch.Tensor) -> bool:
        if suffix not in self.names:
            return False
        if suffix == "weight":  # float weights of unquantized modules share the name
            return tensor.dtype in (FP8_DTYPES if self.quant.format in ("float-quantized", "fp8-block")
                                    else (torch.int8,))
        return True

    def stream(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor | AffineWeight]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in tensors:
            module, _, suffix = name.rpartition(".")
            if not self._is_part(suffix, tensor):
                yield name, tensor
                continue
            if self.quant.ignores(module):
                raise fmt.CheckpointFormatError(
                    f"{name}: module {module} is in the quantization config's ignore list but is stored quantized")
            parts = pending.setdefault(module, {})
            parts[suffix] = tensor
            if self.names <= parts.keys():
                yield module + ".weight", self._convert(module, pending.pop(module))
        for module, parts in pending.items():
            if self.parts.required <= parts.keys():
                yield module + ".weight", self._convert(module, parts)
            else:  # an incomplete set: the loader lists the parts as unexpected, the weight as missing
                yield from ((f"{module}.{suffix}", t) for suffix, t in parts.items())

    def _convert(self, module: str, p: dict[str, torch.Tensor]) -> torch.Tensor | AffineWeight:
        q = self.quant
        try:
            if q.method == "awq":
                weight = fmt.awq_gemm(p["qweight"], p["qzeros"], p["scales"])
            elif q.method == "gptq":
                weight = fmt.gptq(p["qweight"], p["qzeros"], p["scales"], p.get("g_idx"), q.bits, q.format == "gptq_v2")
            elif q.format == "pack-quantized":
                weight = fmt.ct_pack_quantized(p["weight_packed"], p["weight_scale"], p["weight_shape"],
                                               p.get("weight_zero_point"), q.bits)
            elif q.format == "naive-quantized":
                weight = fmt.ct_naive_int8(p["weight"], p["weight_scale"], p.get("weight_zero_point"))
            else:
                scale = p["weight_scale_inv"] if q.format == "fp8-block" else p["weight_scale"]
                self.dequantized.add(module + ".weight")
                return fmt.fp8_dequantize(p["weight"], scale, q.block)
        except fmt.CheckpointFormatError as e:
            raise fmt.CheckpointFormatError(f"{module}: {e}") from None
        if weight.bits != q.bits or (q.group_size or weight.shape[1]) != weight.group_size:
            raise fmt.CheckpointFormatError(
                f"{module}: stored as {weight.bits}-bit groups of {weight.group_size}, but quantization_config says "
                f"{q.bits}-bit groups of {q.group_size or 'in_features'}")
        return weight
