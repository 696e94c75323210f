"""Triton kernels for attention over the paged KV pool: the page table is read inside the kernel, so no
step gathers a request's K/V into a contiguous copy.

Both kernels read keys and values through req_to_token[row, position] (one slot per token, page_size
pages being runs of slots) after the step's new K/V were written to the pool, and use an online softmax
over blocks of keys in float32.
- decode: one query per request; grid (requests, query heads).
- extend: a block of a request's new tokens; grid (requests, query heads, query blocks). Causal unless the
  request has a custom mask (a flattened bool [extend_len, seq_len] at mask_indptr[request], -1 = none).
Both apply an optional sliding window (a query at position p sees keys > p - window).

The GQA group, the window and the slot table's row stride are runtime values left unspecialised: one
compiled kernel per dtype and head size serves every model shape and plan (fewer compiles at first use, and
fewer for `python -m tessera.bench.gpu_compile` to check), at the cost of one integer division per program.

Correctness runs on the CPU under TRITON_INTERPRET=1 (tests/layers/test_triton_attention.py); speed only
means something on a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _decode_request(SeqLens, ReqRows, b, window):
    """Request b's KV length, slot-table row and first visible key (a sliding window moves it).

    Fixed index types whether the plan holds int32 (eager) or int64 (the CUDA-graph buffers): `start` is
    assigned in a runtime branch and must keep one type."""
    seq = tl.load(SeqLens + b).to(tl.int32)
    row = tl.load(ReqRows + b).to(tl.int64)
    start = 0
    if window > 0:
        start = tl.maximum(seq - window, 0)
    return seq, row, start


@triton.jit
def _decode_keys(q, K, V, ReqToToken, row, kv_h, lo, hi, sm_scale, stride_kt, stride_kh, stride_rt, offs_d, d_mask,
                 BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """One query over the request's keys [lo, hi): the online softmax's (unnormalised sum, max, sum of weights)."""
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        slots = tl.load(ReqToToken + row * stride_rt + offs_n, mask=n_mask, other=0)
        kv_off = slots[:, None] * stride_kt + kv_h * stride_kh + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(K + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[None, :] * k, 1) * sm_scale
        s = tl.where(n_mask, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(V + kv_off, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["window", "group", "stride_rt"])
def decode_kernel(Q, K, V, Out, ReqToToken, ReqRows, SeqLens, sm_scale, window, group,
                  stride_qb, stride_qh, stride_kt, stride_kh, stride_ob, stride_oh, stride_rt,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    kv_h = h // group
    seq, row, start = _decode_request(SeqLens, ReqRows, b, window)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    acc, m_i, l_i = _decode_keys(q, K, V, ReqToToken, row, kv_h, start, seq, sm_scale, stride_kt, stride_kh,
                                 stride_rt, offs_d, d_mask, BLOCK_D, BLOCK_N)
    out = acc / l_i
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=d_mask)


@triton.jit(do_not_specialize=["window", "group", "stride_rt"])
def extend_kernel(Q, K, V, Out, ReqToToken, ReqRows, SeqLens, ExtLens, ExtStarts, Masks, MaskIndptr,
                  sm_scale, window, group, stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh,
                  stride_rt, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    # IEEE (float32 inputs): exact float32 dots, as torch computes them. Otherwise the dots take the 16-bit
    # inputs as loaded (tensor cores; a 16-bit tile cast to float32 first does not lower on sm_80/sm_90) and
    # accumulate in float32; the softmax runs in float32 either way.
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    ext = tl.load(ExtLens + b).to(tl.int32)
    if mb * BLOCK_M < ext:
        kv_h = h // group
        seq = tl.load(SeqLens + b).to(tl.int32)
        row = tl.load(ReqRows + b).to(tl.int64)
        q_start = tl.load(ExtStarts + b).to(tl.int32)
        mask_off = tl.load(MaskIndptr + b)
        prefix = seq - ext
        offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < ext
        q_pos = prefix + offs_m
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Causal requests see nothing past this block's last query; masked ones may see the whole sequence.
        kv_end = seq
        if mask_off < 0:
            kv_end = tl.minimum(seq, prefix + (mb + 1) * BLOCK_M)
        for n0 in range(0, kv_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < seq
            slots = tl.load(ReqToToken + row * stride_rt + offs_n, mask=n_mask, other=0)
            kv_off = slots[:, None] * stride_kt + kv_h * stride_kh + offs_d[None, :]
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(K + kv_off, mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale
            else:
                s = tl.dot(q, tl.trans(k)) * sm_scale
            allowed = m_mask[:, None] & n_mask[None, :]
            if mask_off >= 0:
                custom = tl.load(Masks + mask_off + offs_m[:, None] * seq + offs_n[None, :], mask=allowed, other=0)
                allowed = allowed & (custom != 0)
            else:
                allowed = allowed & (offs_n[None, :] <= q_pos[:, None])
            if window > 0:
                allowed = allowed & (offs_n[None, :] > q_pos[:, None] - window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing allowed yet
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            v = tl.load(V + kv_off, mask=kv_mask, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(Out + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["window", "group", "stride_rt"])
def decode_split_kernel(Q, K, V, PartAcc, PartML, ReqToToken, ReqRows, SeqLens, sm_scale, window, group,
                        stride_qb, stride_qh, stride_kt, stride_kh, stride_rt,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                        NUM_SPLITS: tl.constexpr):
    """Split-KV decode, first pass: program (b, h, s) runs the online softmax over the s-th of NUM_SPLITS runs
    of the request's keys (whole BLOCK_N blocks) and leaves its unnormalised sum and (max, sum of weights) in
    PartAcc [B, H, S, BLOCK_D] and PartML [B, H, S, 2], float32. Short contexts leave the later splits empty."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.program_id(2)
    kv_h = h // group
    seq, row, start = _decode_request(SeqLens, ReqRows, b, window)
    per = tl.cdiv(tl.cdiv(seq - start, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = start + sp * per
    hi = tl.minimum(seq, lo + per)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(Q + b * stride_qb + h * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    acc, m_i, l_i = _decode_keys(q, K, V, ReqToToken, row, kv_h, lo, hi, sm_scale, stride_kt, stride_kh, stride_rt,
                                 offs_d, d_mask, BLOCK_D, BLOCK_N)
    part = (b * tl.num_programs(1) + h) * NUM_SPLITS + sp
    tl.store(PartAcc + part * BLOCK_D + offs_d, acc)
    two = tl.arange(0, 2)
    tl.store(PartML + part * 2 + two, tl.where(two == 0, tl.max(m_i, 0), tl.sum(l_i, 0)))


@triton.jit
def decode_reduce_kernel(PartAcc, PartML, Out, stride_ob, stride_oh, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Split-KV decode, second pass: the splits' partial sums rescaled to their common max and normalised."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    base = (b * tl.num_programs(1) + h) * NUM_SPLITS
    offs_s = tl.arange(0, NUM_SPLITS)
    m = tl.load(PartML + (base + offs_s) * 2)
    l = tl.load(PartML + (base + offs_s) * 2 + 1)
    m_max = tl.max(m, 0)
    scale = tl.where(l > 0, tl.exp(m - m_max), 0.0)  # an empty split (max -inf, no weight) adds nothing
    offs_d = tl.arange(0, BLOCK_D)
    acc = tl.load(PartAcc + (base + offs_s)[:, None] * BLOCK_D + offs_d[None, :])
    out = tl.sum(acc * scale[:, None], 0) / tl.sum(l * scale, 0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=offs_d < HEAD_DIM)
