"""The decoder layer's elementwise work as one Triton kernel each, on devices that run Triton (CUDA).

A batch-1 decode step on a GPU is bound by kernel launches and tiny kernels, not by bandwidth: torch's own
operators spend about ten kernels on an RMSNorm in 16 bits (cast, square, mean, add, rsqrt, multiply, cast,
multiply, plus the residual add), eight on a rotary pass and two on the KV write. Here each of those is one
kernel, so a Qwen2-style layer launches nine (SGLang's fused path: norm, QKV, rotary + KV write, attention,
O, add + norm, gate-up, SiLU-mul, down; counted by `python -m tessera.bench.kernel_census`):

- `rmsnorm(x, residual, weight, eps, gemma)`: the residual add and the norm in one pass (one program per row);
  `gemma`: Gemma's (1 + w) scale;
- `gemma_norm_add(a, x, w_post, w_next, eps)`: Gemma's x + norm(a), and the next norm of the sum;
- `silu_and_mul(x)`, `gelu_tanh_and_mul(x)`: the gated MLP's activation (SwiGLU; Gemma's GELU);
- `rotary_store_kv(qkv, cos, sin, k_buf, v_buf, loc, ...)`: the fused QKV projection's output in, q rotated
  out, k rotated and v written straight into the paged pool at the step's slots (with the per-head q/k norms
  of Qwen3 or Gemma-3 first, where the model has them).

Each reproduces the rounding of transformers' float operators step by step (a 16-bit intermediate is rounded
where torch rounds it), so 16-bit results equal torch's but for the order of the norm's sum of squares and the
GPU's approximate exp and rsqrt (an ulp); in float32 they agree to ~1e-7. On a CPU the same kernels run only in
Triton's interpreter (TRITON_INTERPRET=1), where `layers/fused.py` takes them too, so the tests and the kernel
census run the GPU's path there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


@triton.jit
def _norm(h, W, offs, mask, n, eps, dtype: tl.constexpr, GEMMA: tl.constexpr):
    """RMSNorm of the float32 row h, in the model's rounding: Llama/Qwen's casts the normalised value back to
    the dtype before the weight multiply; Gemma's scales by (1 + w) in float32 and casts once."""
    h = h * tl.rsqrt(tl.sum(h * h, 0) / n + eps)
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        return (h * (1.0 + w)).to(dtype)
    return (w * h.to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _rmsnorm_kernel(X, R, W, Out, Sum, stride_x, stride_r, stride_o, stride_s, n, eps,
                    HAS_RES: tl.constexpr, BLOCK: tl.constexpr, GEMMA: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        # The sum in the model's dtype, as torch's `x + residual`: it is the next residual and the norm's input.
        s = (x.to(tl.float32) + tl.load(R + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32))
        x = s.to(Sum.dtype.element_ty)
        tl.store(Sum + row * stride_s + offs, x, mask=mask)
    out = _norm(x.to(tl.float32), W, offs, mask, n, eps, Out.dtype.element_ty, GEMMA)
    tl.store(Out + row * stride_o + offs, out, mask=mask)


def _rows(*tensors: torch.Tensor | None) -> bool:
    """[rows, hidden] operands of one shape and dtype with unit column stride (None entries skipped)."""
    first = next(t for t in tensors if t is not None)
    return all(t is None or (t.dim() == 2 and t.stride(1) == 1 and t.shape == first.shape and t.dtype == first.dtype)
               for t in tensors)


def rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float, gemma: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """norm(x) or (norm(x + residual), x + residual) in one kernel (`gemma`: Gemma's (1 + w) norm); None where
    the operands do not fit it (not [rows, hidden] with unit column stride, or a weight of another dtype: torch's
    form then runs)."""
    if not (_rows(x, residual) and weight.dtype == x.dtype and weight.shape == x.shape[1:]):
        return None
    rows, n = x.shape
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else None
    block = triton.next_power_of_2(n)
    r = residual if residual is not None else x
    s = summed if summed is not None else out
    _rmsnorm_kernel[(rows,)](x, r, weight, out, s, x.stride(0), r.stride(0), out.stride(0), s.stride(0), n, eps,
                             HAS_RES=residual is not None, BLOCK=block, GEMMA=gemma, num_warps=_warps(block))
    return out if summed is None else (out, summed)


@triton.jit
def _norm_add_kernel(A, X, WPost, WNext, Sum, Out, stride_a, stride_x, stride_s, stride_o, n, eps,
                     HAS_NEXT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    dtype = Sum.dtype.element_ty
    a = tl.load(A + row * stride_a + offs, mask=mask, other=0.0).to(tl.float32)
    normed = _norm(a, WPost, offs, mask, n, eps, dtype, True).to(tl.float32)
    s = (tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32) + normed).to(dtype)
    tl.store(Sum + row * stride_s + offs, s, mask=mask)
    if HAS_NEXT:
        tl.store(Out + row * stride_o + offs, _norm(s.to(tl.float32), WNext, offs, mask, n, eps, dtype, True),
                 mask=mask)


def gemma_norm_add(a: torch.Tensor, x: torch.Tensor, w_post: torch.Tensor, w_next: torch.Tensor | None,
                   eps: float) -> tuple[torch.Tensor | None, torch.Tensor] | None:
    """Gemma's sandwich: s = x + norm_post(a), and norm_next(s) when w_next is given, in one kernel ->
    (norm_next(s) or None, s); None where the operands do not fit."""
    if not (_rows(a, x) and all(w is None or (w.dtype == x.dtype and w.shape == x.shape[1:])
                                for w in (w_post, w_next))):
        return None
    rows, n = x.shape
    summed = torch.empty_like(x)
    out = torch.empty_like(x) if w_next is not None else summed
    block = triton.next_power_of_2(n)
    _norm_add_kernel[(rows,)](a, x, w_post, w_next if w_next is not None else w_post, summed, out, a.stride(0),
                              x.stride(0), summed.stride(0), out.stride(0), n, eps, HAS_NEXT=w_next is not None,
                              BLOCK=block, num_warps=_warps(block))
    return (out if w_next is not None else None), summed


@triton.jit
def _gated_mul_kernel(X, Out, stride_x, stride_o, d, BLOCK: tl.constexpr, GELU: tl.constexpr):
    """act(gate) * up: SiLU (SwiGLU), or GELU's tanh form (Gemma); torch rounds the activation's output to the
    dtype before the product, and so does this."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + d + offs, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2/pi) (x + 0.044715 x^3)
        act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0))  # 0.5 x (1 + tanh(inner))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    act = act.to(Out.dtype.element_ty).to(tl.float32)
    tl.store(Out + row * stride_o + offs, (act * up).to(Out.dtype.element_ty), mask=mask)


def _gated(x: torch.Tensor, gelu: bool) -> torch.Tensor | None:
    if not (x.dim() == 2 and x.shape[1] % 2 == 0 and x.stride(1) == 1):
        return None
    rows, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(rows, d, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(d))
    _gated_mul_kernel[(rows, triton.cdiv(d, block))](x, out, x.stride(0), out.stride(0), d, BLOCK=block, GELU=gelu,
                                                     num_warps=_warps(block))
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """[rows, 2d] laid out [gate | up] -> silu(gate) * up [rows, d]; None where x does not fit."""
    return _gated(x, gelu=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """[rows, 2d] laid out [gate | up] -> gelu(gate, approximate="tanh") * up [rows, d] (Gemma's MLP)."""
    return _gated(x, gelu=True)


@triton.jit
def _rotary_store_kernel(QKV, Cos, Sin, QOut, K, V, Loc, QNormW, KNormW, stride_t, stride_cos, stride_qt,
                         stride_qh, stride_kt, stride_kh, num_heads, num_kv_heads, eps,
                         HALF: tl.constexpr, BLOCK: tl.constexpr, QK_NORM: tl.constexpr, GEMMA: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    dtype = QOut.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    src = QKV + t * stride_t + h * (2 * HALF)  # q heads, then k heads: adjacent columns of the projection
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:  # Qwen3: RMSNorm over each head of q and k before the rotation, in RMSNorm's order of rounding
        w_ptr = QNormW if h < num_heads else KNormW
        r = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        if GEMMA:  # (1 + w) in float32, one rounding (Gemma3RMSNorm)
            x1 = (x1 * r * (1.0 + w1)).to(dtype).to(tl.float32)
            x2 = (x2 * r * (1.0 + w2)).to(dtype).to(tl.float32)
        else:
            x1 = (w1 * (x1 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
            x2 = (w2 * (x2 * r).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    cos = tl.load(Cos + t * stride_cos + offs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(Sin + t * stride_cos + offs, mask=mask, other=0.0).to(tl.float32)
    # torch's rotate-half in the model's dtype: each product is rounded to it before the sum (a no-op in
    # float32); the sum is rounded by the store.
    a = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    b = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    o1 = a.to(dtype)
    o2 = b.to(dtype)
    if h < num_heads:
        dst = QOut + t * stride_qt + h * stride_qh
        tl.store(dst + offs, o1, mask=mask)
        tl.store(dst + HALF + offs, o2, mask=mask)
    else:
        kv_h = h - num_heads
        slot = tl.load(Loc + t).to(tl.int64)
        kdst = K + slot * stride_kt + kv_h * stride_kh
        tl.store(kdst + offs, o1.to(K.dtype.element_ty), mask=mask)
        tl.store(kdst + HALF + offs, o2.to(K.dtype.element_ty), mask=mask)
        vsrc = QKV + t * stride_t + (num_heads + num_kv_heads + kv_h) * (2 * HALF)
        vdst = V + slot * stride_kt + kv_h * stride_kh
        tl.store(vdst + offs, tl.load(vsrc + offs, mask=mask, other=0.0).to(V.dtype.element_ty), mask=mask)
        tl.store(vdst + HALF + offs, tl.load(vsrc + HALF + offs, mask=mask, other=0.0).to(V.dtype.element_ty),
                 mask=mask)


def rotary_store_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_buf: torch.Tensor,
                    v_buf: torch.Tensor, loc: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                    qk_norm: tuple[torch.Tensor, torch.Tensor, float, bool] | None = None) -> torch.Tensor | None:
    """qkv [T, (H + 2 Hkv) * D] (q | k | v heads), cos/sin [T, D // 2] -> rotated q [T, H, D]; the rotated k and
    the v of token t are written to k_buf/v_buf [slots, Hkv, D] at slot loc[t]. `qk_norm` = (q weight, k weight,
    eps, gemma): each q and k head RMSNormed first (Qwen3; Gemma's (1 + w) norm when gemma). None where it does
    not fit."""
    half = head_dim // 2
    if not (qkv.dim() == 2 and qkv.stride(1) == 1 and head_dim % 2 == 0 and cos.shape == sin.shape
            and cos.shape == (qkv.shape[0], half) and cos.stride() == sin.stride() and cos.stride(1) == 1
            and k_buf.stride() == v_buf.stride() and k_buf.stride(2) == 1 and k_buf.dtype == v_buf.dtype
            and (qk_norm is None or all(w.dtype == qkv.dtype and w.shape == (head_dim,) for w in qk_norm[:2]))):
        return None
    num_tokens = qkv.shape[0]
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    q_w, k_w, eps, gemma = qk_norm if qk_norm is not None else (qkv, qkv, 0.0, False)
    _rotary_store_kernel[(num_tokens, num_heads + num_kv_heads)](
        qkv, cos, sin, q, k_buf, v_buf, loc, q_w, k_w, qkv.stride(0), cos.stride(0), q.stride(0), q.stride(1),
        k_buf.stride(0), k_buf.stride(1), num_heads, num_kv_heads, eps, HALF=half,
        BLOCK=triton.next_power_of_2(half), QK_NORM=qk_norm is not None, GEMMA=gemma, num_warps=1)
    return q
