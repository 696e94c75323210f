"""`--attention-backend flashinfer`: FlashInfer's paged attention kernels (CUDA; float16/bfloat16), used as
SGLang and mini-sglang use them. This file only plans: the kernels are FlashInfer's.

Layout: a page per token. The pool's K/V buffers [slots, kv_heads, head_dim] are seen as pages of one token
([slots, 1, kv_heads, head_dim], "NHD"), so a request's page list is its slot-table row: kv_indices is
req_to_token[row, :seq_len] of every request back to back and kv_indptr the running sum of the seq lens, both
written on the device (fill_kv_indices); every last page holds its one token.

Per step, one FlashInfer problem for the whole batch:
- decode (every request adds one token, no custom mask): BatchDecodeWithPagedKVCacheWrapper;
- anything else: BatchPrefillWithPagedKVCacheWrapper over the pool (the new K/V are written there first, and
  FlashInfer aligns a request's queries with the end of its keys, so a cached prefix needs nothing more),
  causal, or, when a request of the step has a custom mask (bidirectional image spans), one flattened mask
  for all of them (causal requests spelled out: FlashInfer's mask mode is per launch).
plan() runs on the host once per wrapper and step, run() per layer. Layers differ in what a plan fixes (head
counts, head dim, sliding window, scale: Gemma-3's local and global layers), so a step plans one wrapper per
such kind, on the first layer that asks for it.

Sliding window: FlashInfer's window_left is inclusive (keys >= p - window_left), the contract's window is not
(keys > p - window), hence window_left = window - 1. It applies on top of the causal or custom mask.

CUDA graphs (feature "cuda_graph"): plan() cannot be captured. The graph runner calls plan_graph_decode
before every warm-up, capture and replay of a bucket, outside the graph: it writes the bucket's indptr and
indices into static buffers sized for the largest bucket and plans that bucket's graph-mode decode wrappers
(use_cuda_graph=True over those buffers), one per layer kind seen so far; the captured forward only runs them.
Kinds are learned on the first forward (the runner's eager warm-ups plan a new kind on the spot); a kind
still unplanned while a graph is being captured is an error.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from tessera.cache.kv_pool import TokenToKVPool
from tessera.layers.attention.base import BaseAttentionBackend
from tessera.layers.forward_batch import ForwardBatch
from tessera.platform.device import platform_of

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's split-KV scratch, shared by this backend's wrappers
TENSOR_CORE_MIN_GROUP = 4  # GQA groups from which the decode wrapper runs on tensor cores (mini-sglang's rule)


def fill_kv_indices(req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, max_len: int,
                    indptr: torch.Tensor, indices: torch.Tensor) -> None:
    """Writes kv_indptr into `indptr` ([B + 1] int32: 0, then the running sum of seq_lens) and kv_indices into
    `indices` (int32: req_to_token[rows[b], :seq_lens[b]] for b in order), on the device, without a host read.

    max_len (>= every seq len, from the host plan) bounds the gather. `indices` needs at least sum(seq_lens)
    + 1 elements: its last one takes the writes of the positions past each request's length."""
    indptr[:1].zero_()
    torch.cumsum(seq_lens, 0, out=indptr[1:])
    cols = torch.arange(max_len, device=req_to_token.device)
    table = req_to_token[:, :max_len].index_select(0, rows)  # [B, max_len], only the columns needed
    dest = indptr[:-1, None] + cols[None, :]
    dest = dest.masked_fill(cols[None, :] >= seq_lens[:, None], indices.numel() - 1)
    indices.scatter_(0, dest.reshape(-1), table.reshape(-1).to(indices.dtype))


class _Kind(NamedTuple):
    """What one plan fixes for the layers that share it."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    scaling: float


@dataclass
class _Plan:
    """One step's FlashInfer inputs for all its requests, and the wrappers planned on them so far."""

    fb: ForwardBatch
    decode: bool
    kv_indptr: torch.Tensor  # [B + 1] int32, device
    kv_indices: torch.Tensor  # [kv_indptr[-1]] int32, device
    last_page_len: torch.Tensor  # [B] int32 ones, device
    qo_indptr: torch.Tensor | None = None  # [B + 1] int32, device; prefill only
    custom_mask: torch.Tensor | None = None  # flattened bool masks of all requests; None = causal
    # Host copies of the indptrs (and last page lens) for plan(), which reads them on the host: without
    # them it copies the device ones back. Not used with a custom mask, where FlashInfer derives the mask
    # offsets from these tensors next to the mask, on the device.
    host: tuple[torch.Tensor, ...] | None = None
    graph_bucket: int | None = None  # a graph runner's bucket: its static buffers and graph-mode wrappers
    wrappers: dict[_Kind, Any] = field(default_factory=dict)

    def plan_inputs(self) -> tuple[torch.Tensor, ...]:
        """(qo_indptr, kv_indptr, kv_indices, last_page_len) as plan() gets them (qo_indptr None: decode)."""
        if self.host is not None and self.custom_mask is None:
            qo, kv, last = self.host
            return qo, kv, self.kv_indices, last
        return self.qo_indptr, self.kv_indptr, self.kv_indices, self.last_page_len


@dataclass
class _GraphBuffers:
    """Static indptr/indices/last-page-len buffers for batches of up to max_bs requests; a bucket's wrappers
    are built over views of them, so each replay reads what the last plan wrote."""

    max_bs: int
    indptr: torch.Tensor  # [max_bs + 1] int32
    indices: torch.Tensor  # [max_bs * row width + 1] int32 (the last element: see fill_kv_indices)
    last_page_len: torch.Tensor  # [max_bs] int32 ones


def _capturing(t: torch.Tensor) -> bool:
    return platform_of(t.device).is_capturing()


def _cumsum_host(lens: list[int]) -> torch.Tensor:
    out, acc = [0], 0
    for n in lens:
        acc += n
        out.append(acc)
    return torch.tensor(out, dtype=torch.int32)


class FlashInferAttentionBackend(BaseAttentionBackend):
    features = BaseAttentionBackend.features | {"cuda_graph"}
    dtypes = frozenset({torch.float16, torch.bfloat16})
    reads_new_kv_from_pool = True

    def __init__(self) -> None:
        try:
            self._fi = importlib.import_module("flashinfer")
        except ImportError as e:
            raise ImportError("attention_backend='flashinfer' needs flashinfer-python: "
                              "pip install 'tessera[cuda]'") from e
        self._workspace: torch.Tensor | None = None
        self._plan: _Plan | None = None
        self._prefill: dict[_Kind, Any] = {}
        self._decode: dict[_Kind, Any] = {}
        self._kinds: dict[_Kind, None] = {}  # every kind a layer asked for (ordered set)
        self._graph: _GraphBuffers | None = None
        self._graph_wrappers: dict[tuple[int, _Kind], Any] = {}
        self._graph_plan: _Plan | None = None  # the bucket planned last by plan_graph_decode

    # ---- per step -----------------------------------------------------------------------------------
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        self._plan = self._plan_for(fb)

    def _plan_for(self, fb: ForwardBatch) -> _Plan:
        g = self._graph_plan
        # A decode_only batch over the runner's static inputs is the one plan_graph_decode planned (another
        # ForwardBatch object over the same buffers: the runner builds a fresh one per run).
        if fb.decode_only and g is not None and g.fb.seq_lens.data_ptr() == fb.seq_lens.data_ptr() and \
                g.fb.req_pool_indices.data_ptr() == fb.req_pool_indices.data_ptr() and \
                g.fb.batch_size == fb.batch_size:
            g.fb = fb
            return g
        return self._eager_plan(fb)

    @staticmethod
    def _eager_plan(fb: ForwardBatch) -> _Plan:
        ext, seq, _, _ = fb.host_plan()
        device = fb.req_to_token.device
        indptr = torch.empty(len(seq) + 1, dtype=torch.int32, device=device)
        indices = torch.empty(sum(seq) + 1, dtype=torch.int32, device=device)
        fill_kv_indices(fb.req_to_token, fb.req_pool_indices, fb.seq_lens, max(seq, default=0), indptr, indices)
        last = torch.ones(len(seq), dtype=torch.int32, device=device)
        host_last = torch.ones(len(seq), dtype=torch.int32)
        masks = fb.custom_masks
        has_mask = masks is not None and any(m is not None for m in masks)
        indices = indices[:-1]  # without the overflow element
        if all(e == 1 for e in ext) and not has_mask:
            return _Plan(fb, True, indptr, indices, last, host=(None, _cumsum_host(seq), host_last))
        qo_indptr = torch.zeros(len(ext) + 1, dtype=torch.int32, device=device)
        torch.cumsum(fb.extend_lens, 0, out=qo_indptr[1:])
        mask = _flat_masks(masks, ext, seq, device) if has_mask else None
        return _Plan(fb, False, indptr, indices, last, qo_indptr, mask,
                     host=(_cumsum_host(ext), _cumsum_host(seq), host_last))

    def forward(self, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, layer_id: int, fb: ForwardBatch,
                pool: TokenToKVPool, scaling: float, sliding_window: int | None = None) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        if k is not None and v is not None:
            pool.set_kv(layer_id, fb.out_cache_loc, k, v)
        if self._plan is None or self._plan.fb is not fb:
            self._plan = self._plan_for(fb)
        kind = _Kind(num_heads, pool.num_kv_heads, head_dim, sliding_window or None, q.dtype, pool.dtype, scaling)
        wrapper = self._plan.wrappers.get(kind)
        if wrapper is None:
            wrapper = self._plan_wrapper(self._plan, kind)
        k_buf, v_buf = pool.get_kv(layer_id)
        out = wrapper.run(q.contiguous(), (k_buf.unsqueeze(1), v_buf.unsqueeze(1)))
        return out.reshape(num_tokens, num_heads * head_dim)

    def _plan_wrapper(self, plan: _Plan, kind: _Kind) -> Any:
        if _capturing(plan.kv_indptr):
            raise RuntimeError(f"flashinfer: a layer of kind {kind} was reached while capturing a CUDA graph "
                               "without a plan; plan_graph_decode plans the kinds seen in eager runs before it")
        if kind.q_dtype not in self.dtypes or kind.kv_dtype not in self.dtypes:
            raise ValueError(f"attention_backend='flashinfer' runs float16/bfloat16 attention, got q {kind.q_dtype} "
                             f"and KV {kind.kv_dtype}: choose --attention-backend triton or --dtype bfloat16")
        self._kinds.setdefault(kind)
        wrapper = self._wrapper(plan, kind)
        qo_indptr, kv_indptr, kv_indices, last = plan.plan_inputs()
        common = dict(window_left=kind.window - 1 if kind.window else -1, q_data_type=kind.q_dtype,
                      kv_data_type=kind.kv_dtype, sm_scale=kind.scaling, non_blocking=True)
        if plan.decode:
            wrapper.plan(kv_indptr, kv_indices, last, kind.num_heads, kind.num_kv_heads, kind.head_dim, 1,
                         **common)
        else:
            wrapper.plan(qo_indptr, kv_indptr, kv_indices, last, kind.num_heads, kind.num_kv_heads, kind.head_dim,
                         1, custom_mask=plan.custom_mask, causal=plan.custom_mask is None, **common)
        plan.wrappers[kind] = wrapper
        return wrapper

    def _wrapper(self, plan: _Plan, kind: _Kind) -> Any:
        """This kind's wrapper for the plan's shape of problem, made on first use and kept."""
        if self._workspace is None:
            self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=plan.kv_indptr.device)
        tensor_cores = kind.num_heads // kind.num_kv_heads >= TENSOR_CORE_MIN_GROUP
        if not plan.decode:
            if kind not in self._prefill:
                self._prefill[kind] = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
            return self._prefill[kind]
        if plan.graph_bucket is None:
            if kind not in self._decode:
                self._decode[kind] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "NHD", use_tensor_cores=tensor_cores)
            return self._decode[kind]
        key = (plan.graph_bucket, kind)
        if key not in self._graph_wrappers:
            g = self._graph
            assert g is not None
            bs = plan.graph_bucket
            # A graph-mode wrapper keeps these buffers (and a fixed batch size) for its lifetime: its
            # captured kernels read them at these addresses on every replay.
            self._graph_wrappers[key] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
                paged_kv_indptr_buffer=g.indptr[:bs + 1], paged_kv_indices_buffer=g.indices[:-1],
                paged_kv_last_page_len_buffer=g.last_page_len[:bs])
        return self._graph_wrappers[key]

    # ---- CUDA graphs --------------------------------------------------------------------------------
    def plan_graph_decode(self, fb: ForwardBatch, max_bs: int, host_seq_lens: list[int] | None = None) -> None:
        device = fb.req_to_token.device
        if self._graph is None:
            width = fb.req_to_token.shape[1]
            self._graph = _GraphBuffers(
                max_bs, torch.zeros(max_bs + 1, dtype=torch.int32, device=device),
                torch.zeros(max_bs * width + 1, dtype=torch.int32, device=device),
                torch.ones(max_bs, dtype=torch.int32, device=device))
        g = self._graph
        bs = fb.batch_size
        assert bs <= g.max_bs == max_bs, (bs, g.max_bs, max_bs)  # the buffers must outlive every capture
        lens = host_seq_lens if host_seq_lens is not None else fb.seq_lens.tolist()  # outside the graph
        assert len(lens) == bs, (len(lens), bs)
        fill_kv_indices(fb.req_to_token, fb.req_pool_indices, fb.seq_lens, max(lens), g.indptr[:bs + 1], g.indices)
        host = (None, _cumsum_host(lens), torch.ones(bs, dtype=torch.int32)) if host_seq_lens is not None else None
        # plan() copies the indices it is given into the wrapper's buffer (here: onto themselves), so it gets
        # the used part only, not the whole buffer.
        plan = _Plan(fb, True, g.indptr[:bs + 1], g.indices[:sum(lens)], g.last_page_len[:bs], host=host,
                     graph_bucket=bs)
        for kind in self._kinds:
            self._plan_wrapper(plan, kind)
        self._graph_plan = plan


def _flat_masks(masks: list[torch.Tensor | None] | None, ext: list[int], seq: list[int],
                device: torch.device) -> torch.Tensor:
    """Every request's bool [extend_len, seq_len] mask, flattened and concatenated in request order (FlashInfer's
    custom_mask layout, offsets implied by qo_indptr and kv_indptr); causal where the request has none."""
    masks = masks or [None] * len(seq)
    assert len(masks) == len(seq), "custom_masks must have one entry per request"
    parts = []
    for i, (e, s, m) in enumerate(zip(ext, seq, masks)):
        if m is None:
            m = torch.arange(s, device=device)[None, :] <= torch.arange(s - e, s, device=device)[:, None]
        else:
            assert tuple(m.shape) == (e, s), f"custom mask {i}: {tuple(m.shape)} != {(e, s)}"
            m = m.to(device=device, dtype=torch.bool)
        parts.append(m.reshape(-1))
    return torch.cat(parts)
