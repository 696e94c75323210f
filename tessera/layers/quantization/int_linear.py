"""Products with weight-only int8 / int4 weights: an AffineWeight packed once for the kernel chosen here.

Which kernel runs is decided at pack time from the device and the weight's shape:
- "c": our C kernels (platform/csrc/cpu_int_gemv.c) for products of up to max_rows() rows (torchao int4 ones
  over x rounded to bf16 where bf16 products are on: int4_kernel); more rows (a
  prefill) dequantize the weight to float32 with the C kernel and run torch's matmul (measured faster from
  there than the kernel, and not slower than float32: docs/benchmarks.md, "Weight-only int8 / int4"); where
  the CPU has bf16 dot products (half_linear.bf16_products), that matmul is oneDNN's bf16 one over the
  dequantized weight rounded to bf16, as for a bf16 model.
- "torch": torch's packed CPU ops (_weight_int8pack_mm, _weight_int4pack_mm_for_cpu), only where
  TESSERA_INT_KERNEL=torch asks: they measured slower than ours on AVX2 and, by 9-120x, on AVX-512 + AMX.
- "affine": the AffineWeight kept as it is and dequantized by torch operators for every product (the C
  kernels did not build, or an int4 shape they do not take: groups or rows not a multiple of 16).
Off the host (CUDA) the caller keeps the dequantized weight in the compute dtype instead (layers/linear.py).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tessera.config import TORCHAO_CONFIGS
from tessera.layers import cpu_gemv, half_linear
from tessera.layers.quantization.affine import AffineWeight, quantize
from tessera.platform import cpu_kernels
from tessera.platform.device import is_host

PATH_NAMES = {"c": "C int{bits} gemv + dequantized prefill", "torch": "torch int{bits}pack",
              "affine": "int{bits} dequantized by torch per product"}


def parse_scheme(name: str) -> tuple[int, int | None, bool]:
    """--torchao-config name -> (bits, group size or None for per channel, symmetric): int8wo is torchao's
    int8_weight_only (per-channel symmetric), int4wo-G its int4_weight_only (groups of G, float zero)."""
    if name not in TORCHAO_CONFIGS:
        raise ValueError(f"torchao_config: expected one of {', '.join(TORCHAO_CONFIGS)}, got {name!r}")
    if name == "int8wo":
        return 8, None, True
    return 4, int(re.fullmatch(r"int4wo-(\d+)", name).group(1)), False


def prefers_torch_ops() -> bool:
    """Whether torch's int8pack / int4pack CPU ops run the products instead of our C kernels: only when
    TESSERA_INT_KERNEL=torch asks (=c or unset: ours). On the one AVX-512 + AMX CPU measured (a Sapphire
    Rapids Xeon, torch 2.14.1) torch's ops ran 9-120x slower than ours at 1-256 rows (docs/benchmarks.md,
    "Measured on a CPU with AVX-512 and AMX")."""
    return os.environ.get("TESSERA_INT_KERNEL", "") == "torch"


def max_rows() -> int:
    """The most rows the C kernel takes; more go through a dequantized float32 weight. The float gemv's
    limits held for the int kernels too (measured: docs/benchmarks.md)."""
    return cpu_gemv.max_rows()


def int4_kernel(bf16_activations: bool) -> str:
    """The C kernel of an int4 weight's products of up to max_rows() rows. For a weight whose format takes bf16
    activations (bf16_activations: torchao's int4 kernels do) with bf16 products on (half_linear), the one that
    rounds x to bf16 and runs AVX512-BF16 dot products where the CPU has them (1.5-2.3x the float kernel over
    bench-medium's weights at 1-8 rows: docs/benchmarks.md); the float32 one otherwise (as for pre-quantized
    checkpoints, which HF runs over float activations)."""
    if bf16_activations and half_linear.bf16_products() and cpu_kernels.available("int4_gemv_bf16x"):
        return "int4_gemv_bf16x"
    return "int4_gemv"


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] (values < 16, K a multiple of 16) -> [N, K / 2]: chunk c of 16 columns is 8 bytes,
    byte i = q[16c + i] | q[16c + 8 + i] << 4 (cpu_int_gemv.c's layout)."""
    n, k = q.shape
    chunks = q.reshape(n, k // 16, 2, 8)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


class PackedIntWeight:
    """One linear weight [out, in] in the packed form of one kernel; call it as the product x @ w.T (+ bias).
    Holds no float copy of the weight. bf16_activations: the weight's format takes x in bf16 (torchao's int4
    weight-only kernels take bf16 activations; what SGLang runs with --torchao-config int4wo-G), so the C path may
    round x to bf16 (int4_kernel)."""

    def __init__(self, weight: AffineWeight, path: str | None = None, bf16_activations: bool = False):
        self.bits, self.group_size = weight.bits, weight.group_size
        self.bf16_activations = bf16_activations and weight.bits == 4
        self.out_features, self.in_features = weight.shape
        self.path = path or self._choose(weight)
        if self.path == "c":
            offset = 128.0 if self.bits == 8 else 0.0  # int8 is stored signed (q - 128), int4 as is
            q = weight.q.contiguous()
            self.q = (q ^ 128).view(torch.int8) if self.bits == 8 else _pack_int4(q)
            self.scale = weight.scale.float().contiguous()
            self.zs = ((weight.zero.float() - offset) * self.scale).contiguous()
        elif self.path == "torch":
            self._pack_torch(weight)
        elif self.path == "affine":
            self.affine = weight
        else:
            raise ValueError(f"unknown int kernel path {self.path!r}")

    def _choose(self, weight: AffineWeight) -> str:
        inp = weight.shape[1]
        if not is_host(weight.q.device):
            raise ValueError("PackedIntWeight runs on the CPU; off it the layer keeps a dequantized weight")
        if self.bits == 4:
            torch_ok = (self.group_size in (32, 64, 128, 256) and self.out_features % 16 == 0  # its packing's rule
                        and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))
        else:
            torch_ok = self.group_size == inp and weight.symmetric and hasattr(torch, "_weight_int8pack_mm")
        if torch_ok and prefers_torch_ops():
            return "torch"
        c_shape = self.bits == 8 or (self.group_size % 16 == 0 and inp % 16 == 0)
        if c_shape and cpu_kernels.available(f"int{self.bits}_gemv") and cpu_kernels.available("int_dequant"):
            return "c"
        return "affine"

    def _pack_torch(self, weight: AffineWeight) -> None:
        if self.bits == 8:  # symmetric per channel: w = (q - 128) * scale
            self.q = (weight.q.contiguous() ^ 128).view(torch.int8)
            self.scale = weight.scale[:, 0].float().contiguous()
        else:  # torch's int4: w = (q - 8) * scale + zero, scales_and_zeros [K / group, N, 2]
            self.q = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.q.to(torch.int32).contiguous(), 1)
            zero_f = (8.0 - weight.zero.float()) * weight.scale.float()
            self.scale = torch.stack([weight.scale.float(), zero_f], dim=-1).transpose(0, 1).contiguous()

    @property
    def kernel(self) -> str:
        """The C kernel of the few-row products (the "c" path)."""
        return "int8_gemv" if self.bits == 8 else int4_kernel(self.bf16_activations)

    @property
    def description(self) -> str:
        """What runs this weight's products, as get_server_info and the startup log report it."""
        name = PATH_NAMES[self.path].format(bits=self.bits)
        return f"{name} (bf16 products)" if self.path != "torch" and half_linear.bf16_products() else name

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [out, in] in float32 (what a many-row product multiplies by) or rounded to bfloat16; the
        "torch" path keeps only torch's packing and multiplies every product through it instead."""
        if self.path == "affine":
            return self.affine.dequantize().to(dtype)
        if self.path != "c":
            raise RuntimeError(f"the {self.path} path keeps no dequantizable weight")
        kernel = {torch.float32: "int_dequant", torch.bfloat16: "int_dequant_bf16"}[dtype]
        if not cpu_kernels.available(kernel):
            return self.dequantize().to(dtype)
        w = torch.empty(self.out_features, self.in_features, dtype=dtype)
        cpu_kernels.call(kernel, self.q.data_ptr(), self.scale.data_ptr(), self.zs.data_ptr(), w.data_ptr(),
                         self.out_features, self.in_features, self.group_size, self.bits, torch.get_num_threads())
        return w

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None,
                 dense: Callable[..., torch.Tensor] = F.linear) -> torch.Tensor:
        """x [..., in] @ w.T (+ bias), in x's dtype; `dense` runs the many-row products on the float32
        weight (layers/linear.linear, so that oneDNN's and our float choices apply there too)."""
        lead, dtype = x.shape[:-1], x.dtype
        x2 = x.reshape(-1, self.in_features)
        if dtype != torch.float32:
            x2 = x2.float()
        b32 = bias if bias is None or bias.dtype is torch.float32 else bias.float()
        if self.path == "c" and x2.shape[0] <= max_rows() and cpu_kernels.host_f32_inference(x2, b32):
            y = self._c_gemv(x2.contiguous(), b32)
        elif self.path == "torch":
            y = self._torch_mm(x2.contiguous())
            y = y if b32 is None else y + b32
        elif x2.shape[0] > max_rows() and half_linear.bf16_products():  # 3x the float32 sgemm at 256 rows
            y = half_linear.bf16_linear(x2, self.dequantize(torch.bfloat16), b32)
        else:
            y = dense(x2, self.dequantize(), b32)
        return y.to(dtype).reshape(*lead, self.out_features)

    def _c_gemv(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        m = x.shape[0]
        y = torch.empty(m, self.out_features, dtype=torch.float32)
        cpu_kernels.call(self.kernel, x.data_ptr(), self.q.data_ptr(), self.scale.data_ptr(),
                         self.zs.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(), m,
                         self.out_features, self.in_features, self.group_size, torch.get_num_threads())
        return y

    def _torch_mm(self, x: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return torch._weight_int8pack_mm(x, self.q, self.scale)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.q, self.group_size, self.scale)


def quantize_linears(model: torch.nn.Module, scheme: str, prefix: str = "model.") -> str:
    """Quantizes (round to nearest) every float Linear of the language model (our modules under `prefix`;
    the encoders, the embeddings, the LM head and MoE routers stay float; so does, as in torchao, a linear
    whose input features are not a multiple of the group size), one module at a time, each float weight
    freed as its quantized one is set. Returns what runs, for the startup log and get_server_info."""
    bits, group, symmetric = parse_scheme(scheme)
    paths: dict[str, int] = {}
    kept = 0
    for name, module in model.named_modules():
        # layers/linear's Linear and its subclasses (by what they offer: that module imports this one).
        if not (hasattr(module, "set_quantized") and getattr(module, "quantized", 0) is None
                and name.startswith(prefix) and not getattr(module, "is_router", False)):
            continue
        if group is not None and module.in_features % group:
            kept += 1  # as torchao: a row that does not split into whole groups stays float
            continue
        module.set_quantized(quantize(module.weight, bits, group, symmetric), bf16_activations=bits == 4)
        paths[module.quant_path] = paths.get(module.quant_path, 0) + 1
    if not paths:
        raise ValueError(f"torchao_config {scheme}: the model has no language-model linear layer to quantize "
                         f"(with {kept} whose input features are not a multiple of {group})")
    runs = ", ".join(f"{p} ({n} linears)" if len(paths) > 1 or kept else p for p, n in paths.items())
    float_too = f", {kept} linears float (input features not a multiple of {group})" if kept else ""
    return f"{scheme} (torchao-config), {runs}{float_too}; encoders, embeddings and LM head float"


@torch.no_grad()
def fake_quantize_(model: torch.nn.Module, scheme: str, prefix: str) -> int:
    """Replaces the weight of every torch.nn.Linear under `prefix` by the dequantized weight of the same
    quantization quantize_linears applies (and skips the same linears): a float model (HF's, as a
    reference) that computes what our quantized one does. Returns how many linears it changed."""
    bits, group, symmetric = parse_scheme(scheme)
    count = 0
    for name, module in model.named_modules():
        if (isinstance(module, torch.nn.Linear) and name.startswith(prefix)
                and (group is None or module.in_features % group == 0)):
            module.weight.copy_(quantize(module.weight, bits, group, symmetric).dequantize(module.weight.dtype))
            count += 1
    return count
