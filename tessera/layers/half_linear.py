"""Products of float32 activations with 16-bit (bfloat16 / float16) weights on a CPU.

A 16-bit model on a CPU keeps its weights in 16 bits and computes in float32 (Platform.computes_16bit): every
product is the float32 product of the upcast weight, i.e. what the checkpoint's weights say, read at 2 bytes
per value. Which way each product runs, by rows of x (figures: docs/benchmarks.md, "16-bit weights on a CPU"):

- few rows (decode): cpu_gemv16.c widens the weight in registers and streams it once (bound by the read);
- more rows (prefill): the weight widened to float32 in blocks into a reused buffer, then torch's sgemm.
  The widening is ~2% of the sgemm at 256 rows, while torch's own bfloat16 / float16 matmuls ran 5-7x
  slower than float32 on an AVX2 CPU (no AVX512-BF16 / AMX).

Where the CPU multiplies bfloat16 itself (`avx512_bf16` or `amx_bf16` in /proc/cpuinfo), many rows of a bf16
weight go to oneDNN's bf16 matmul instead: x rounded to bf16, float32 accumulation, the result rounded to bf16
and returned as float32, as SGLang/vLLM/HF compute a bf16 model. On a Zen 5 (AVX512-BF16, no AMX) it took
bench-medium's 48 products at 256 rows 4.6x faster than the widened sgemm, and won from 8 rows; on a Sapphire
Rapids Xeon (AMX) 2.1-2.7x. It moves logprobs by bf16 rounding (0.025 on a tiny model), so
TESSERA_BF16_COMPUTE=0 keeps float32 compute, the same numbers on every CPU; =1 asks for it on any CPU (oneDNN
then emulates bf16, slowly). Few rows (decode) keep the float32 kernel: it is faster there and exact.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tessera.layers import cpu_gemv
from tessera.platform import cpu_kernels
from tessera.platform.device import is_host

HALF_DTYPES = (torch.bfloat16, torch.float16)
_KERNEL = {torch.bfloat16: "gemv_bf16", torch.float16: "gemv_f16"}
# Values of one widened block: 16 MB of float32, L2/L3-sized; a weight up to this size is widened whole.
BLOCK_VALUES = 1 << 22
_scratch = threading.local()  # per thread (TP ranks are processes; tests may run models on threads)


def bf16_compute_wanted() -> bool:
    """Whether many-row bf16 products round x to bf16 for oneDNN's bf16 matmul: TESSERA_BF16_COMPUTE=1 / 0,
    else (unset or `auto`) where the CPU has bf16 dot products (AVX512-BF16 or AMX)."""
    value = os.environ.get("TESSERA_BF16_COMPUTE", "auto").strip().lower()
    if value in ("0", "1"):
        return value == "1"
    if value not in ("", "auto"):
        raise ValueError(f"TESSERA_BF16_COMPUTE must be 0, 1 or auto, got {value!r}")
    return bool({"avx512_bf16", "amx_bf16"} & cpu_kernels.cpu_flags())


_BF16_COMPUTE = bf16_compute_wanted()


def bf16_products() -> bool:
    """Whether this process runs many-row products over 16-bit and int weights in bf16 (bf16_compute_wanted)."""
    return _BF16_COMPUTE


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] float32 @ weight [N, K] bfloat16 .T (+ float32 bias) through oneDNN's bf16 matmul, in float32."""
    y = F.linear(x.to(torch.bfloat16), weight).float()
    if bias is not None:
        y += bias
    return y


def applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this product is float32 x over a 16-bit weight on the host (what `linear` sends here)."""
    return weight.dtype in HALF_DTYPES and x.dtype == torch.float32 and is_host(x.device) and is_host(weight.device)


Linear32 = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def half_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp32_linear: Linear32) -> torch.Tensor:
    """x @ weight.T (+ bias) in float32 for a bfloat16/float16 weight; call where `applies` said so.
    `fp32_linear` runs a float32 product (layers/linear.py's `linear`, with its own per-shape choices)."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    m = rows.shape[0]
    if (m <= cpu_gemv.max_rows() and weight.dim() == 2 and rows.shape[1] == weight.shape[1]
            and (bias is None or (bias.dtype == torch.float32 and bias.shape == weight.shape[:1]))
            and not torch.is_grad_enabled() and cpu_kernels.available(_KERNEL[weight.dtype])):
        y = _gemv16(rows.contiguous(), weight.contiguous(), bias)
    elif _BF16_COMPUTE and weight.dtype == torch.bfloat16:
        y = bf16_linear(rows, weight, bias)
    else:
        y = _widened_linear(rows, weight, bias, fp32_linear)
    return y if x.dim() == 2 else y.view(*x.shape[:-1], weight.shape[0])


def _gemv16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    (m, k), n = x.shape, weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    cpu_kernels.call(_KERNEL[weight.dtype], x.data_ptr(), weight.data_ptr(),
                     None if bias is None else bias.contiguous().data_ptr(), y.data_ptr(), m, n, k,
                     torch.get_num_threads())
    return y


def _buffer(values: int) -> torch.Tensor:
    """A float32 buffer of at least `values`, kept for the next call: a fresh one of many MB costs its page
    faults on every call (measured: more than the widening itself)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < values:
        buf = _scratch.buf = torch.empty(values, dtype=torch.float32)
    return buf


def _widened_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    fp32_linear: Linear32) -> torch.Tensor:
    """F.linear over the weight widened to float32 in blocks of output rows (the sgemm's result is the same
    float32 product whichever block a row is in)."""
    if torch.is_grad_enabled() or weight.dim() != 2:
        return F.linear(x, weight.float(), bias)
    n, k = weight.shape
    block = max(1, BLOCK_VALUES // max(k, 1))
    if block >= n:
        return fp32_linear(x, _buffer(n * k)[: n * k].view(n, k).copy_(weight), bias)
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    buf = _buffer(block * k)
    for n0 in range(0, n, block):
        rows = min(block, n - n0)
        y[:, n0:n0 + rows] = fp32_linear(x, buf[: rows * k].view(rows, k).copy_(weight[n0:n0 + rows]),
                                         None if bias is None else bias[n0:n0 + rows])
    return y


def describe(dtype: torch.dtype) -> str:
    """How products over `dtype` weights run in this process (get_server_info and the startup log)."""
    name = str(dtype).removeprefix("torch.")
    few = (f"C kernel {_KERNEL[dtype]} up to {cpu_gemv.GEMV_MAX_ROWS} rows ({cpu_gemv.GEMV_MAX_ROWS_ONE_THREAD} on "
           "one thread)" if cpu_kernels.available(_KERNEL[dtype])
           else f"no {_KERNEL[dtype]} kernel ({cpu_kernels.status()[_KERNEL[dtype]]})")
    if _BF16_COMPUTE and dtype == torch.bfloat16:
        return f"{name} weights: {few} in float32; more rows: x rounded to bfloat16, oneDNN bf16 matmul"
    return f"{name} weights, float32 compute: {few}; more rows: weight widened to float32 in blocks, then sgemm"
