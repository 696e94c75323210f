"""A recording stand-in for the `flashinfer` module (no GPU here): its wrapper classes check and record the
plan()/run() calls our backend makes and compute attention with `reference_attention`, which follows
FlashInfer's definitions and reads K/V only through the planned indptr/indices (and masks/windows as passed).

Like FlashInfer, plan() keeps copies of what it was given (read back to the host), and a wrapper built with
use_cuda_graph=True copies them into the buffers it was built over and runs from those buffers, as a replayed
graph does; its batch size is fixed by those buffers."""

from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, qo_indptr: list[int],
                        kv_indptr: list[int], kv_indices: torch.Tensor, custom_mask: torch.Tensor | None,
                        causal: bool, window_left: int, sm_scale: float) -> torch.Tensor:
    """FlashInfer's paged attention with page size 1: request b's queries are q[qo_indptr[b]:qo_indptr[b+1]],
    its keys the pages kv_indices[kv_indptr[b]:kv_indptr[b+1]]; query i of qo_len sits at position
    kv_len - qo_len + i; custom_mask is every request's [qo_len, kv_len] mask flattened back to back; a key j
    is in the window when j >= position - window_left (-1: no window)."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    mask_at = 0
    for b in range(len(kv_indptr) - 1):
        qs, qe, ks, ke = qo_indptr[b], qo_indptr[b + 1], kv_indptr[b], kv_indptr[b + 1]
        qo_len, kv_len = qe - qs, ke - ks
        pages = kv_indices[ks:ke].long()
        k = k_cache[pages, 0].float().repeat_interleave(group, 1)  # [kv_len, H, D]
        v = v_cache[pages, 0].float().repeat_interleave(group, 1)
        pos = torch.arange(kv_len - qo_len, kv_len)[:, None]
        key = torch.arange(kv_len)[None, :]
        allowed = torch.ones(qo_len, kv_len, dtype=torch.bool)
        if custom_mask is not None:
            allowed = custom_mask[mask_at:mask_at + qo_len * kv_len].view(qo_len, kv_len).cpu()
            mask_at += qo_len * kv_len
        elif causal:
            allowed = key <= pos
        if window_left >= 0:
            allowed = allowed & (key >= pos - window_left)
        scores = torch.einsum("thd,shd->hts", q[qs:qe].float(), k) * sm_scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[qs:qe] = torch.einsum("hts,shd->thd", scores.softmax(-1), v).to(q.dtype)
    return out


@dataclass
class Recorder:
    """Every call in order: ("init", wrapper) / ("plan", wrapper, kwargs) / ("run", wrapper)."""

    calls: list[tuple] = field(default_factory=list)
    capturing: bool = False  # a test sets it while it stands for a CUDA-graph capture

    def of(self, what: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == what]


class _Wrapper:
    decode = False
    recorder: Recorder  # set per fake module

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None) -> None:
        assert kv_layout == "NHD" and workspace.dtype == torch.uint8
        self.use_cuda_graph, self.use_tensor_cores = use_cuda_graph, use_tensor_cores
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        if use_cuda_graph:
            assert all(isinstance(b, torch.Tensor) for b in self.buffers)
            assert len(paged_kv_indptr_buffer) == len(paged_kv_last_page_len_buffer) + 1
        self.planned: dict | None = None
        self.recorder.calls.append(("init", self))

    def _plan(self, qo_indptr: list[int], indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor,
              num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, **kw) -> None:
        assert not self.recorder.capturing, "plan() inside a CUDA-graph capture"
        assert page_size == 1 and indptr.dtype == indices.dtype == last.dtype == torch.int32
        kv_indptr = indptr.tolist()  # FlashInfer reads indptr on the host
        assert len(last) == len(kv_indptr) - 1 and last.eq(1).all() and len(indices) >= kv_indptr[-1]
        if self.use_cuda_graph:
            ind_buf, idx_buf, last_buf = self.buffers
            assert len(last) == len(last_buf), "graph-mode batch size is fixed by the buffers"
            ind_buf.copy_(indptr)
            idx_buf[:len(indices)].copy_(indices)
            last_buf.copy_(last)
        else:
            indices = indices[:kv_indptr[-1]].clone()
        self.planned = dict(qo_indptr=qo_indptr, kv_indices=indices, num_qo_heads=num_qo_heads,
                            num_kv_heads=num_kv_heads, head_dim=head_dim, kv_indptr=kv_indptr, **kw)
        self.recorder.calls.append(("plan", self, dict(self.planned)))

    def run(self, q: torch.Tensor, paged_kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        p = self.planned
        assert p is not None, "run() before plan()"
        k_cache, v_cache = paged_kv_cache
        assert k_cache.dim() == 4 and k_cache.shape[1] == 1 and k_cache.shape[2] == p["num_kv_heads"]
        assert q.shape[1:] == (p["num_qo_heads"], p["head_dim"]) and q.dtype == p["q_data_type"]
        assert k_cache.dtype == p["kv_data_type"]
        # As FlashInfer's kernels: q contiguous, and everything on the device the plan was made on.
        assert q.is_contiguous() and q.device == k_cache.device == v_cache.device == p["kv_indices"].device
        kv_indptr, kv_indices = p["kv_indptr"], p["kv_indices"]
        if self.use_cuda_graph:  # a replay reads the buffers as they are now
            kv_indptr, kv_indices = self.buffers[0].tolist(), self.buffers[1]
        qo_indptr = p["qo_indptr"] if not self.decode else list(range(len(kv_indptr)))
        assert q.shape[0] == qo_indptr[-1]
        self.recorder.calls.append(("run", self))
        return reference_attention(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, p.get("custom_mask"),
                                   p.get("causal", False), p["window_left"], p["sm_scale"])


class _Prefill(_Wrapper):
    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
             num_kv_heads, head_dim_qk, page_size, **kw) -> None:
        assert qo_indptr.dtype == torch.int32 and qo_indptr.device == paged_kv_indptr.device
        mask = kw.get("custom_mask")
        assert mask is None or (mask.dtype == torch.bool and mask.device == paged_kv_indptr.device)
        self._plan(qo_indptr.tolist(), paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                   num_kv_heads, head_dim_qk, page_size, **kw)


class _Decode(_Wrapper):
    decode = True

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, **kw) -> None:
        assert "custom_mask" not in kw and "causal" not in kw
        self._plan(list(range(len(indptr))), indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
                   page_size, **kw)


def fake_flashinfer() -> tuple[types.ModuleType, Recorder]:
    """A fresh fake module (to put in sys.modules["flashinfer"]) and the recorder its wrappers write to."""
    rec = Recorder()
    mod = types.ModuleType("flashinfer")
    mod.BatchPrefillWithPagedKVCacheWrapper = type("BatchPrefillWithPagedKVCacheWrapper", (_Prefill,),
                                                   {"recorder": rec})
    mod.BatchDecodeWithPagedKVCacheWrapper = type("BatchDecodeWithPagedKVCacheWrapper", (_Decode,),
                                                  {"recorder": rec})
    return mod, rec
