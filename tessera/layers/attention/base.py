"""The attention-backend contract: paged KV write + per-request attention over a ForwardBatch."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tessera.cache.kv_pool import TokenToKVPool
from tessera.layers.forward_batch import ForwardBatch


class BaseAttentionBackend(ABC):
    """Computes attention for the flattened tokens of a ForwardBatch over a paged KV cache.

    Contract of `forward(q, k, v, layer_id, fb, pool, scaling)`:
      - q is [T, num_heads, head_dim]; k and v are [T, num_kv_heads, head_dim] for the T = sum(extend_lens)
        new tokens of this step, flattened in request order (rows of request i start at
        fb.extend_start_loc[i]). num_heads must be a multiple of num_kv_heads (GQA; MHA when equal).
      - First writes k, v into `pool` for `layer_id` at slots fb.out_cache_loc (one slot per row); k and v
        are None when the caller has written them there itself (only to a backend that says
        `reads_new_kv_from_pool`: the fused rotary + KV write of layers/triton_ops.py),
        then, for each request i, lets its queries attend over the keys/values at slots
        fb.req_to_token[fb.req_pool_indices[i], :fb.seq_lens[i]] (which include the slots just written).
      - Mask: query j of request i sits at absolute position prefix_len + j (prefix_len = seq_len - extend_len)
        and may attend key positions 0..prefix_len + j (causal), unless fb.custom_masks[i] is not None:
        then that bool [extend_len, seq_len] tensor decides (True = may attend). A mask row must allow at
        least one key, otherwise the row's output is undefined.
      - sliding_window (optional): a query at position p also sees only keys at positions > p - window (the
        window applies on top of the causal or custom mask).
      - Scores are q.k * scaling, softmax over the allowed keys.
      - Returns [T, num_heads * head_dim] in q's dtype, rows in the same order as q.

    Backends may precompute per-step state (gather indices, masks) in `init_forward_metadata`, which the
    model calls once per forward before layer 0; `forward` must still be correct if it was not called
    (it then builds that state itself on the first layer). The state belongs to one ForwardBatch object:
    a backend must never reuse it for a different batch.
    """

    # What a backend does beyond causal paged attention; families list what they need (Family.backend_needs)
    # and load_model refuses a backend that lacks it.
    features: frozenset[str] = frozenset({"custom_mask", "sliding_window"})
    # The dtypes of q and the KV pool the backend runs; None = any. load_model refuses a model outside them.
    dtypes: frozenset[torch.dtype] | None = None

    name = "unnamed"  # its registry name, set by get_attention_backend
    # Whether forward reads the step's new K/V only from the pool (after writing them there), so that a layer
    # may write them itself and pass k = v = None.
    reads_new_kv_from_pool = False

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        """Prepares per-step state shared by all layers. Default: nothing to prepare."""

    def plan_graph_decode(self, fb: ForwardBatch, max_bs: int, host_seq_lens: list[int] | None = None) -> None:
        """Called by the CUDA-graph runner outside any captured region before each warm-up, capture and replay
        of a bucket: `fb` is the decode_only batch over its static inputs (the model's forward then sees
        another ForwardBatch object over the same tensors), max_bs its largest bucket, host_seq_lens the
        step's lengths when known. A backend whose kernels must be planned on the host plans here; the default
        does nothing (a backend that plans decode_only batches on the device inside the graph)."""

    def paged_decode_plan(self, fb: ForwardBatch, pool: TokenToKVPool,
                          num_heads: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(slots, lens) when this step's attention may be run over the pool by the CPU decode kernel outside
        the backend (layers/decode_stack.py); None (the default): the layers call forward()."""
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor | None,
        v: torch.Tensor | None,
        layer_id: int,
        fb: ForwardBatch,
        pool: TokenToKVPool,
        scaling: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """See the class docstring. Returns [T, num_heads * head_dim]."""
