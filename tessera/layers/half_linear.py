"""Products of float32 activations with 16-bit (bfloat16 / float16) weights on a CPU.

A 16-bit model on a CPU keeps its weights in 16 bits and computes in float32 (Platform.computes_16bit): every
product is the float32 product of the upcast weight, i.e. what the checkpoint's weights say, read at 2 bytes
per value. Which way each product runs, by rows of x (figures: docs/benchmarks.md, "16-bit weights on a CPU"):

- few rows (decode): cpu_gemv16.c widens the weight in registers and streams it once (bound by the read);
- more rows (prefill): the weight widened to float32 in blocks into a reused buffer, then torch's sgemm.
  The widening is ~2% of the sgemm at 256 rows, while torch's own bfloat16 / float16 matmuls ran 5-7x
  slower than float32 on an AVX2 CPU (no AVX512-BF16 / AMX).

Where the CPU has AMX (`amx_bf16`), oneDNN's bfloat16 matmul runs on its tiles: on a Sapphire Rapids Xeon it
took a 256-row product over a bf16 weight 2.1-2.7x faster than the widened sgemm, but it rounds x to bfloat16,
which moved a tiny model's logprobs by 0.025 where the float32 contract holds them within 1e-4. So it is opt-in
(TESSERA_BF16_AMX=1), and the default gives every CPU the same numbers.
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


def amx_bf16_wanted() -> bool:
    """Whether many-row bf16 products go to oneDNN's bf16 matmul: asked for (TESSERA_BF16_AMX=1) and AMX present."""
    return os.environ.get("TESSERA_BF16_AMX", "0") == "1" and "amx_bf16" in cpu_kernels.cpu_flags()


_AMX_BF16 = amx_bf16_wanted()


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
    elif _AMX_BF16 and weight.dtype == torch.bfloat16:
        y = F.linear(rows.to(torch.bfloat16), weight).float()
        if bias is not None:
            y += bias
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
    many = ("x in bfloat16 through oneDNN (AMX)" if _AMX_BF16 and dtype == torch.bfloat16
            else "weight widened to float32 in blocks, then sgemm")
    return f"{name} weights, float32 compute: {few}; more rows: {many}"
