"""DeepSeek-V3's mixture of experts (Kimi-K2's text model): its router, the routed experts and the shared experts.

Routing (transformers' DeepseekV3TopkRouter, in float32): scores = sigmoid(x W^T); the experts are CHOSEN by
scores + e_score_correction_bias, group-limited: the experts form n_group groups, a group's score is the sum of
its two best biased scores, only the topk_group best groups take part, and the top-k experts are picked among
them. The chosen experts are WEIGHTED by their unbiased scores, normalised to sum 1 when norm_topk_prob, times
routed_scaling_factor. The output is sum_k w_k expert_k(x) plus the shared experts' gated MLP of x (one MLP of
moe_intermediate_size x n_shared_experts).

The routed sum is the shared grouped expert computation (layers/moe.grouped_experts, weights on the experts'
outputs), over its stacked layout: gate_up [E, hidden, 2 * inter] ([gate | up] on the last dim) and down
[E, inter, hidden]. DeepSeek-V3 checkpoints store one F.linear weight per expert and projection
(`experts.3.gate_proj.weight` [inter, hidden]), which the loader writes, transposed, into its slice of the stack
(ExpertStack.load_shard).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tessera.distributed.parallel_state import tp_group
from tessera.layers.decoder import GatedActivation, GatedMLP
from tessera.layers.moe import grouped_experts


class DeepseekRouter(nn.Module):
    """forward(x [T, hidden]) -> (weights [T, k] float32, expert ids [T, k])."""

    def __init__(self, text: Any):
        super().__init__()
        self.num_experts = int(text.n_routed_experts)
        self.top_k = int(text.num_experts_per_tok)
        self.num_groups = int(getattr(text, "n_group", None) or 1)
        self.topk_group = int(getattr(text, "topk_group", None) or self.num_groups)
        self.norm_topk_prob = bool(getattr(text, "norm_topk_prob", True))
        self.routed_scaling_factor = float(getattr(text, "routed_scaling_factor", 1.0))
        if self.num_experts % self.num_groups:
            raise ValueError(f"n_routed_experts={self.num_experts} is not a multiple of n_group={self.num_groups}")
        per_group = self.num_experts // self.num_groups
        if not 1 <= self.topk_group <= self.num_groups or not 1 <= self.top_k <= self.topk_group * per_group:
            raise ValueError(f"num_experts_per_tok={self.top_k}, topk_group={self.topk_group}: the chosen groups "
                             f"(of {per_group} experts each, {self.num_groups} groups) must hold the top-k experts")
        if per_group < 2:
            raise ValueError(f"n_group={self.num_groups}: each group needs at least 2 experts (its score is the "
                             "sum of its best two)")
        # transformers keeps both in float32 whatever the model's dtype (_keep_in_fp32_modules_strict).
        self.weight = nn.Parameter(torch.empty(self.num_experts, int(text.hidden_size), dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.empty(self.num_experts, dtype=torch.float32),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = (x.float() @ self.weight.float().t()).sigmoid()
        biased = scores + self.e_score_correction_bias.float()
        t = x.shape[0]
        if self.topk_group < self.num_groups:
            group_scores = biased.view(t, self.num_groups, -1).topk(2, dim=-1).values.sum(dim=-1)
            groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
            biased = biased.masked_fill(~keep.repeat_interleave(self.num_experts // self.num_groups, dim=1),
                                        float("-inf"))
        ids = biased.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class ExpertStack(nn.Module):
    """One stacked weight [E, in, out] (x @ weight[e]) whose checkpoint tensors are F.linear weights [out, in] per
    expert ("3") or per expert and part ("3.gate", "3.up": consecutive column blocks of `parts`)."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, parts: tuple[str, ...] = ()):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, in_features, out_features))
        self.parts = parts
        self.shard_ids = [f"{e}.{p}" if p else str(e) for e in range(num_experts) for p in (parts or ("",))]

    @torch.no_grad()
    def load_shard(self, param_name: str, shard_id: str, loaded: torch.Tensor) -> None:
        expert, _, part = shard_id.partition(".")
        cols = self.weight.shape[2] // max(len(self.parts), 1)
        start = self.parts.index(part) * cols if part else 0
        target = self.weight[int(expert), :, start:start + cols]
        if tuple(loaded.shape) != (cols, self.weight.shape[1]):
            raise ValueError(f"expert shard {shard_id!r}: checkpoint shape {tuple(loaded.shape)}, "
                             f"want {(cols, self.weight.shape[1])}")
        target.copy_(loaded.t())


class DeepseekMoE(nn.Module):
    """forward(x [T, hidden]) -> [T, hidden]; see the module docstring. Names as transformers': `gate` (the router),
    `experts.gate_up` / `experts.down`, `shared_experts`."""

    def __init__(self, text: Any):
        super().__init__()
        if tp_group().size != 1:
            raise NotImplementedError("mixture-of-experts layers do not support tensor parallelism (tp_size > 1)")
        hidden, inter = int(text.hidden_size), int(text.moe_intermediate_size)
        self.gate = DeepseekRouter(text)
        self.gate.lora_refusal = "LoRA on the MoE router is not supported"
        num = self.gate.num_experts
        self.experts = nn.Module()
        self.experts.gate_up = ExpertStack(num, hidden, 2 * inter, ("gate", "up"))
        self.experts.down = ExpertStack(num, inter, hidden)
        self.act = GatedActivation(str(text.hidden_act))
        shared = int(getattr(text, "n_shared_experts", None) or 0)
        self.shared_experts = GatedMLP(hidden, inter * shared, str(text.hidden_act)) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        shared = None if self.shared_experts is None else self.shared_experts(x)
        return grouped_experts(x, self.experts.gate_up.weight, self.experts.down.weight, ids, weights, self.act,
                               out=shared)
