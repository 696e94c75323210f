"""QuantConfig: a pre-quantized checkpoint's `quantization_config` (config.json), read once with the model config.

Three families of checkpoints are read (AWQ, GPTQ, compressed-tensors) plus HF's block-wise FP8. Each one
names its scheme differently; here they become one description: which tensors a quantized linear stores
(`format`), its bits and group size, whether it has zero points, and which modules stay float (`ignore`).
Anything outside what the loader unpacks is refused here, at load, in one line that says what is supported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Iterable
from typing import Any

SUPPORTED = ("compressed-tensors (pack-quantized int4/int8 weight-only, naive-quantized int8 weight-only, "
             "float-quantized fp8 per-tensor/per-channel/block with dynamic activations), awq (gemm, 4-bit, with "
             "zero points), gptq (4/8-bit, desc_act false, checkpoint_format gptq or gptq_v2), "
             "fp8 (HF's block-wise, dynamic activations)")


class UnsupportedQuantizationError(ValueError):
    """The checkpoint's quantization scheme is not one the loader reads."""


def _refuse(scheme: str) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(f"quantization_config: {scheme} is not supported; supported: {SUPPORTED}")


@dataclass(frozen=True)
class QuantConfig:
    """format: how a quantized linear is stored: "awq" (qweight/qzeros/scales, packed along the output),
    "gptq" / "gptq_v2" (the same names, packed along the input; v1 stores zero - 1), "pack-quantized"
    (weight_packed/weight_scale/weight_shape[/weight_zero_point]), "naive-quantized" (an int8 weight with
    weight_scale[/weight_zero_point]), "float-quantized" (an fp8 weight with weight_scale) or "fp8-block"
    (an fp8 weight with weight_scale_inv per block).
    group_size None: one group per output row (per channel; per tensor for fp8 with a single scale).
    ignore: module names as the config lists them; `ignore_by_substring` (AWQ's and HF's
    modules_to_not_convert) matches them as substrings, otherwise as compressed-tensors does (a name, or
    "re:" and a regex matched from the start)."""

    method: str
    format: str
    bits: int
    group_size: int | None
    symmetric: bool
    ignore: tuple[str, ...] = ()
    ignore_by_substring: bool = False
    strategy: str = ""  # fp8: "tensor", "channel" or "block"
    block: tuple[int, int] | None = None  # fp8 block shape (rows, columns)

    @property
    def scheme(self) -> str:
        """A short name for logs and /get_server_info, e.g. "awq 4-bit g128"."""
        if self.format in ("float-quantized", "fp8-block"):
            shape = f"block {self.block[0]}x{self.block[1]}" if self.block else f"per-{self.strategy}"
            name = "fp8" if self.method == "fp8" else f"{self.method} fp8"
            return f"{name} {shape}, dynamic activations"
        group = f"g{self.group_size}" if self.group_size else "per-channel"
        zeros = "sym" if self.symmetric else "asym"
        fmt = f" {self.format}" if self.method == "compressed-tensors" else ""
        return f"{self.method}{fmt} {self.bits}-bit {group} {zeros}"

    def describe(self, paths: Iterable[str]) -> str:
        """The scheme and what runs its linears (the loader's answers, e.g. "dequantized to float32"), for
        /get_server_info and the startup log."""
        return ", ".join([self.scheme, *sorted(set(paths))])

    def ignores(self, module: str) -> bool:
        """Whether the config leaves `module` (a checkpoint module name) unquantized."""
        for entry in self.ignore:
            if self.ignore_by_substring:
                if entry in module:
                    return True
            elif entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif module == entry or module.endswith("." + entry):
                return True
        return False

    @classmethod
    def from_hf(cls, hf_config: Any) -> QuantConfig | None:
        """The config's `quantization_config` (a dict, or transformers' config object), None when absent."""
        qc = getattr(hf_config, "quantization_config", None)
        if qc is None:
            return None
        if not isinstance(qc, dict):
            qc = qc.to_dict() if hasattr(qc, "to_dict") else vars(qc)
        method = str(qc.get("quant_method", "")).lower()
        if method == "awq":
            return _awq(qc)
        if method == "gptq":
            return _gptq(qc)
        if method == "compressed-tensors":
            return _compressed_tensors(qc)
        if method == "fp8":
            return _hf_fp8(qc)
        raise _refuse(f"quant_method {method!r}")


def _not_convert(qc: dict) -> tuple[str, ...]:
    return tuple(qc.get("modules_to_not_convert") or ())


def _awq(qc: dict) -> QuantConfig:
    version = str(qc.get("version", "gemm")).lower()
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if version != "gemm":
        raise _refuse(f"awq version {version!r}")
    if bits != 4:
        raise _refuse(f"awq bits {bits}")
    if not qc.get("zero_point", True):
        raise _refuse("awq zero_point false")
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    return QuantConfig("awq", "awq", 4, group if group > 0 else None, False, _not_convert(qc), True)


def _gptq(qc: dict) -> QuantConfig:
    bits = int(qc.get("bits", 4))
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if bits not in (4, 8):
        raise _refuse(f"gptq bits {bits}")
    if qc.get("desc_act"):
        raise _refuse("gptq desc_act true (act-order g_idx)")
    if qc.get("is_marlin_format") or fmt not in ("gptq", "gptq_v2"):
        raise _refuse(f"gptq checkpoint_format {'marlin' if qc.get('is_marlin_format') else fmt!r}")
    if qc.get("dynamic"):
        raise _refuse("gptq per-module dynamic overrides")
    group = int(qc.get("group_size", 128))
    return QuantConfig("gptq", fmt, bits, group if group > 0 else None, bool(qc.get("sym", True)),
                       _not_convert(qc), True)


def _hf_fp8(qc: dict) -> QuantConfig:
    if str(qc.get("activation_scheme", "dynamic")) != "dynamic":
        raise _refuse(f"fp8 activation_scheme {qc.get('activation_scheme')!r}")
    block = qc.get("weight_block_size")
    if not block or len(block) != 2:
        raise _refuse("fp8 without weight_block_size")
    return QuantConfig("fp8", "fp8-block", 8, None, True, _not_convert(qc), True, "block",
                       (int(block[0]), int(block[1])))


def _compressed_tensors(qc: dict) -> QuantConfig:
    for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if qc.get(key):
            raise _refuse(f"compressed-tensors {key}")
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise _refuse("compressed-tensors without config_groups")
    distinct = {repr((g.get("weights"), g.get("input_activations"), g.get("output_activations"), g.get("format")))
                for g in groups}
    if len(distinct) > 1:
        raise _refuse("compressed-tensors with several schemes in config_groups")
    group = groups[0]
    fmt = str(group.get("format") or qc.get("format") or "")
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    wtype, bits = str(weights.get("type", "int")), int(weights.get("num_bits", 8))
    strategy = str(weights.get("strategy", "tensor"))
    name = f"compressed-tensors {fmt} {wtype}{bits} {strategy}"
    if group.get("output_activations"):
        raise _refuse(f"{name} with output activation quantization")
    if weights.get("actorder") == "group":
        raise _refuse(f"{name} actorder group (g_idx)")
    ignore = tuple(qc.get("ignore") or ())
    if fmt == "float-quantized":
        if wtype != "float" or bits != 8 or strategy not in ("tensor", "channel", "block"):
            raise _refuse(name)
        if acts and not (acts.get("type") == "float" and acts.get("dynamic") in (True, "true")):
            raise _refuse(f"{name} with static activation scales")
        block = weights.get("block_structure")
        return QuantConfig("compressed-tensors", fmt, 8, None, True, ignore, False, strategy,
                           (int(block[0]), int(block[1])) if strategy == "block" and block else None)
    if acts:
        raise _refuse(f"{name} with {acts.get('type')}{acts.get('num_bits')} activation quantization")
    if wtype != "int" or strategy not in ("group", "channel"):
        raise _refuse(name)
    if fmt == "pack-quantized" and bits in (4, 8) or fmt in ("naive-quantized", "int-quantized") and bits == 8:
        size = int(weights["group_size"]) if strategy == "group" else None
        return QuantConfig("compressed-tensors", "pack-quantized" if fmt == "pack-quantized" else "naive-quantized",
                           bits, size, bool(weights.get("symmetric", True)), ignore)
    raise _refuse(name)
