"""Mixture-of-experts feed-forward with a shared expert (Llama-4's `feed_forward` on its MoE layers).

Routing follows transformers' Llama4TextMoe exactly: the router picks the top-k experts by logit, each chosen
expert's score is sigmoid(logit) (not a softmax over the top-k), and the score scales the expert's INPUT
(expert(x * score), not score * expert(x): the gated MLP is not linear, so the two differ). The shared expert
sees every token unscaled; the result is shared(x) + sum over the chosen experts.

Experts keep transformers' stacked parameter layout, so the checkpoint loads as it is:
`experts.gate_up_proj` [E, hidden, 2 * inter] ([gate | up] along the last dim) and `experts.down_proj`
[E, inter, hidden]. Only the tokens routed to an expert go through it (a gather per expert), where
transformers runs every expert over every token with zeroed inputs: the same sums, up to float order.
Tensor parallelism is not supported here (every rank would hold every expert).
"""

from __future__ import annotations

import torch
from torch import nn

from tessera.distributed.parallel_state import tp_group
from tessera.layers.decoder import GatedActivation, GatedMLP
from tessera.layers.linear import Linear


class StackedExperts(nn.Module):
    """E gated MLPs in two stacked parameters (transformers' Llama4TextExperts layout)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))
        self.act = GatedActivation(act)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """x [n, hidden] through expert e -> [n, hidden]."""
        return self.act(x @ self.gate_up_proj[e]) @ self.down_proj[e]


class SigmoidTopKMoE(nn.Module):
    """forward(x [T, hidden]) -> [T, hidden]; see the module docstring for the routing."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, act: str):
        super().__init__()
        if tp_group().size != 1:
            raise NotImplementedError("mixture-of-experts layers do not support tensor parallelism (tp_size > 1)")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_local_experts={num_experts}")
        self.top_k = top_k
        self.router = Linear(hidden_size, num_experts, bias=False)
        # Refused at adapter load (layers/lora/adapter.py): a router adapter changes which experts run, and PEFT
        # cannot wrap transformers' Llama4Router (it returns scores and logits), so none could be checked.
        self.router.lora_refusal = "LoRA on the MoE router is not supported"
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size, act)
        self.shared_expert = GatedMLP(hidden_size, intermediate_size, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)  # [T, E]
        top_logits, top_experts = torch.topk(logits, self.top_k, dim=-1)
        scores = torch.sigmoid(top_logits.float()).to(x.dtype)  # [T, k]
        out = self.shared_expert(x)
        # One gather + matmul per expert that has tokens; (token, slot) pairs are grouped by expert.
        flat_experts = top_experts.reshape(-1)
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.experts.num_experts).tolist()
        tokens = order // self.top_k
        routed_in = x[tokens] * scores.reshape(-1)[order, None]
        routed_out = torch.empty_like(routed_in)
        start = 0
        for e, n in enumerate(counts):
            if n:
                routed_out[start:start + n] = self.experts.expert(e, routed_in[start:start + n])
            start += n
        return out.index_add_(0, tokens, routed_out)
