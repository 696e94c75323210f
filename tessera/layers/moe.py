"""Mixture-of-experts feed-forward: the shared grouped expert computation and the routers of the MoE families.

`grouped_experts` is the one expert computation every MoE family runs (Llama-4, Qwen3-VL-MoE, and the families
that reuse them). Given x [T, H], each token's k chosen experts `topk_ids` [T, k] and their weights
`topk_weights` [T, k], and the experts' stacked weights, it returns sum_j w[t, j] * expert_{ids[t, j]}(x[t])
(weights on the output: Qwen, Mixtral, DeepSeek) or sum_j expert_{ids[t, j]}(w[t, j] * x[t]) (weights on the
input: Llama-4; the gated MLP is not linear, so the two differ). The (token, slot) pairs are sorted by expert
once; then every expert's rows go through its gate/up and down products in one call each:
- CPU: torch._grouped_mm over the sorted rows (offsets = the running counts), no Python loop at all. Measured
  against a loop of per-expert matmuls over the same sorted rows (one thread, E=64, H=512, I=256, k=8; a
  shared 2-core machine, medians): 512 tokens 25.4 vs 34.2 ms, 64 tokens 11.5 vs 13.8 ms, 4 tokens 1.9 vs
  2.1 ms, 1 token 0.87 vs 0.72 ms (within the machine's noise); E=128, H=1024, I=384, 512 tokens: 113 vs
  192 ms. A batched bmm over groups padded to the largest one was slower everywhere (padding and scatter).
  Where torch lacks _grouped_mm (or it refuses the dtype) the per-expert loop runs instead.
- Where the layers run Triton (layers/fused.active: CUDA, or the interpreter): one Triton kernel per product
  over the expert-sorted rows (layers/moe_triton.py); no host read, so a CUDA graph captures it.

Stacked weight layout (Llama-4's checkpoints and the original Qwen3-VL-MoE ones; what the kernels take):
`gate_up_proj` [E, H, 2 * I] with [gate | up] along the last dim, `down_proj` [E, I, H]; x @ w. transformers 5
saves Qwen3-VL-MoE in F.linear's layout instead; StackedExperts transposes it once at load.
Tensor parallelism shards each expert's intermediate dim (StackedExperts.load_param takes this rank's
columns of gate and of up and its rows of down); the routed sum is then partial and the caller all-reduces it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tessera.distributed.parallel_state import all_reduce, tp_group
from tessera.layers import fused
from tessera.layers.decoder import GatedActivation, GatedMLP
from tessera.layers.linear import Linear


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order [T*k]: the flattened (token, slot) pairs sorted by expert, stable; tokens [T*k]: each sorted pair's
    token; counts [E]: pairs per expert)."""
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, order // topk_ids.shape[1], torch.bincount(flat, minlength=num_experts)


def _grouped_products(rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor,
                      act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """rows [N, H] sorted by expert (counts[e] rows for expert e) -> act(rows @ w13[e]) @ w2[e] per group."""
    if hasattr(torch, "_grouped_mm"):
        offs = counts.cumsum(0).to(torch.int32)
        try:
            return torch._grouped_mm(act(torch._grouped_mm(rows, w13, offs=offs)), w2, offs=offs)
        except RuntimeError:  # rows not 16-byte multiples (odd test sizes) or a dtype it refuses: the loop below
            pass
    out = rows.new_empty(rows.shape[0], w2.shape[-1])
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            out[start:start + n] = act(rows[start:start + n] @ w13[e]) @ w2[e]
        start += n
    return out


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                    topk_weights: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor] | str = "silu", *,
                    weights_on_input: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' sum for every token (see the module docstring).

    x [T, H]; w13 [E, H, 2I] ([gate | up] on the last dim); w2 [E, I, H]; topk_ids [T, k] (int, any order,
    no repeats needed); topk_weights [T, k] (cast to x's dtype); act: [n, 2I] -> [n, I] (a GatedActivation,
    or its name). weights_on_input: scale each expert's input by its weight (Llama-4) instead of its output.
    out: [T, H] to accumulate into (e.g. a shared expert's output); a new zero tensor when None.
    Returns [T, H] (`out` when given). Where the layers run Triton, the Triton kernel runs it (layers/moe_triton.py).
    """
    if isinstance(act, str):
        act = GatedActivation(act)
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must "
                         f"both be [{x.shape[0]}, k]")
    if out is None:
        out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    weights = topk_weights.to(x.dtype)
    if fused.active(x):  # CUDA, and any tensor under TRITON_INTERPRET=1 (tests run the GPU's path there)
        from tessera.layers.moe_triton import triton_grouped_experts

        return out.add_(triton_grouped_experts(x, w13, w2, topk_ids, weights, act, weights_on_input))
    order, tokens, counts = sort_by_expert(topk_ids, w13.shape[0])
    rows = x[tokens]
    pair_weights = weights.reshape(-1)[order, None]
    if weights_on_input:
        rows = rows * pair_weights
    routed = _grouped_products(rows, w13, w2, counts, act)
    if not weights_on_input:
        routed = routed * pair_weights
    return out.index_add_(0, tokens, routed)


class StackedExperts(nn.Module):
    """E gated MLPs in two stacked parameters (the layout in the module docstring); under tensor parallelism
    each rank holds its share of every expert's intermediate dim."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str,
                 linear_layout: bool = False):
        super().__init__()
        self.num_experts = num_experts
        # transformers' module keeps F.linear's layout ([E, 2I, H], [E, H, I]; Qwen3-VL-MoE) and saves it so.
        self.linear_layout = linear_layout
        self.hidden_size, self.full_intermediate = hidden_size, intermediate_size
        self.start, inter = tp_group().shard(intermediate_size, "moe intermediate_size")
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(num_experts, inter, hidden_size))
        self.act = GatedActivation(act)

    def full_parameter_count(self) -> int:
        """Every rank's share together (layers/linear.count_parameters)."""
        return 3 * self.num_experts * self.hidden_size * self.full_intermediate

    @torch.no_grad()
    def load_param(self, param_name: str, loaded: torch.Tensor) -> None:
        """The checkpoint's full stacked tensor into this rank's share. With linear_layout, a tensor of the
        F.linear shape is taken as that layout (as transformers' loader decides, even where both shapes agree)
        and anything else as ours (the original Qwen3-VL-MoE checkpoints' layout)."""
        E, H, I = self.num_experts, self.hidden_size, self.full_intermediate
        want, linear = {"gate_up_proj": ((E, H, 2 * I), (E, 2 * I, H)),
                        "down_proj": ((E, I, H), (E, H, I))}[param_name]
        if self.linear_layout and tuple(loaded.shape) == linear:
            loaded = loaded.transpose(1, 2)
        if tuple(loaded.shape) != want:
            raise ValueError(f"checkpoint {tuple(loaded.shape)}, want {want}")
        param = getattr(self, param_name)
        inter = param.shape[1] if param_name == "down_proj" else param.shape[2] // 2
        if param_name == "gate_up_proj":
            loaded = torch.cat([loaded[..., self.start:self.start + inter],
                                loaded[..., I + self.start:I + self.start + inter]], dim=-1)
        else:
            loaded = loaded[:, self.start:self.start + inter]
        param.copy_(loaded)

    @torch.no_grad()
    def load_expert(self, param_name: str, shard_id: str, loaded: torch.Tensor) -> bool:
        """One expert's F.linear weight (shard "3.gate", "3.up" or "3.down" of a checkpoint that keeps experts
        apart) into this rank's share of the stacked parameter; True once every expert's have come."""
        index, kind = shard_id.split(".")
        e, inter = int(index), self.down_proj.shape[1]
        H, I = self.hidden_size, self.full_intermediate
        want = (H, I) if kind == "down" else (I, H)
        if tuple(loaded.shape) != want or not 0 <= e < self.num_experts:
            raise ValueError(f"expert {e} {kind}_proj: checkpoint {tuple(loaded.shape)}, want {want}")
        if kind == "down":
            self.down_proj[e].copy_(loaded[:, self.start:self.start + inter].t())
        else:
            column = 0 if kind == "gate" else inter
            self.gate_up_proj[e, :, column:column + inter].copy_(loaded[self.start:self.start + inter].t())
        seen = self.__dict__.setdefault("_loaded_experts", set())
        seen.add(shard_id)
        per_param = [s for s in seen if (s.endswith(".down")) == (kind == "down")]
        return len(per_param) == self.num_experts * (1 if kind == "down" else 2)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                weights_on_input: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
        return grouped_experts(x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights, self.act,
                               weights_on_input=weights_on_input, out=out)


def _check_top_k(top_k: int, num_experts: int) -> None:
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")


class SigmoidTopKMoE(nn.Module):
    """Llama-4's `feed_forward` on its MoE layers (transformers' Llama4TextMoe): the router picks the top-k
    experts by logit, each chosen expert's score is sigmoid(logit) (not a softmax over the top-k) and scales the
    expert's INPUT; the shared expert sees every token unscaled; the result is shared(x) + the routed sum.
    Tensor parallelism is not supported here."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, act: str):
        super().__init__()
        if tp_group().size != 1:
            raise NotImplementedError("Llama-4's mixture-of-experts layers do not support tensor parallelism "
                                      "(tp_size > 1)")
        _check_top_k(top_k, num_experts)
        self.top_k = top_k
        self.router = Linear(hidden_size, num_experts, bias=False)
        # Refused at adapter load (layers/lora/adapter.py): a router adapter changes which experts run, and PEFT
        # cannot wrap transformers' Llama4Router (it returns scores and logits), so none could be checked.
        self.router.lora_refusal = "LoRA on the MoE router is not supported"
        self.router.is_router = True  # stays float under --torchao-config (its choices are discrete)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size, act)
        self.shared_expert = GatedMLP(hidden_size, intermediate_size, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_logits, top_experts = torch.topk(self.router(x), self.top_k, dim=-1)
        scores = torch.sigmoid(top_logits.float())
        return self.experts(x, top_experts, scores, weights_on_input=True, out=self.shared_expert(x))


class SoftmaxTopKMoE(nn.Module):
    """The Qwen MoE block (transformers' Qwen3VLMoeTextSparseMoeBlock): softmax over all experts' logits in
    float32, the top-k probabilities, renormalised to sum to 1 when `norm_topk_prob` (Qwen3-VL-MoE always),
    cast to x's dtype, scale each expert's OUTPUT. No shared expert. The router is `gate` [E, H] as in the
    checkpoint. Under tensor parallelism every rank routes alike (the router is replicated) and computes its
    share of every expert's intermediate dim; the partial sums are all-reduced."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, act: str,
                 norm_topk_prob: bool = True):
        super().__init__()
        _check_top_k(top_k, num_experts)
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.gate.lora_refusal = "LoRA on the MoE router is not supported"
        self.gate.is_router = True
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size, act, linear_layout=True)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_ids [T, k], topk_weights [T, k] in x's dtype)."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        return all_reduce(self.experts(x, ids, weights))


class SharedExpertMoE(SoftmaxTopKMoE):
    """The Qwen2-MoE block (Qwen3-Next, Qwen3.5-MoE): SoftmaxTopKMoE's routed experts plus a shared expert that
    sees every token, scaled by sigmoid(shared_expert_gate(x)) [T, 1]. Tensor parallelism is not supported here."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, act: str,
                 norm_topk_prob: bool, shared_intermediate_size: int):
        super().__init__(hidden_size, intermediate_size, num_experts, top_k, act, norm_topk_prob)
        self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, act)
        self.shared_expert_gate = Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.route(x)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, ids, weights, out=shared)
