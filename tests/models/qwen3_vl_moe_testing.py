"""Test helpers for Qwen3-VL-MoE: Qwen3-VL's (qwen3_vl_testing.py: prompts, DeepStack, positions, the parity row)
with the MoE text fields in the spec, so HF builds Qwen3VLMoeForConditionalGeneration.

The spec is Qwen3-VL's "gqa" one (H = 64, GQA 4/2, DeepStack levels 0 and 2) with MoE layers 0 and 2 and a dense
layer 1 (`mlp_only_layers`): top-3 of 7 experts of I = 12 (HF's default grouped matmul needs rows of 16-byte
multiples). Beyond Qwen3-VL's checks, the fixture checks the routing can
fail: on the decode prompt every MoE layer sends tokens to most experts, no expert is everyone's first choice,
the renormalised weights differ between tokens, and one expert's weights move the logits.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from tests.models import qwen3_vl_testing as q3
from tests.models.family_parity import ATOL, our_logits

MOE_FIELDS = (("num_experts", 7), ("num_experts_per_tok", 3), ("moe_intermediate_size", 12),
              ("decoder_sparse_step", 1), ("mlp_only_layers", [1]))
SPECS = {"moe": dataclasses.replace(q3.SPECS["gqa"], name="moe", seed=0, moe=MOE_FIELDS)}
CHECKPOINT_SPEC = dataclasses.replace(q3.CHECKPOINT_SPEC, name="moe_ckpt", moe=MOE_FIELDS)
load_hf_reference = q3.load_hf_reference  # reads the architecture from config.json


def routed_experts(case: q3.Qwen3VLCase, prompt) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per MoE layer of our model: (top-k expert ids [T, k], their weights [T, k]) over the prompt's prefill."""
    from tessera.layers.moe import SoftmaxTopKMoE

    seen, hooks = {}, []
    for i, layer in enumerate(case.ours.model.layers):
        if isinstance(layer.mlp, SoftmaxTopKMoE):
            hooks.append(layer.mlp.register_forward_hook(
                lambda mod, args, out, i=i: seen.__setitem__(i, mod.route(args[0]))))
    try:
        our_logits(case, prompt)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def check_routing_can_fail(case: q3.Qwen3VLCase) -> None:
    spec_fields = dict(case.spec.moe)
    num_experts, top_k = spec_fields["num_experts"], spec_fields["num_experts_per_tok"]
    prompt = case.prompt(q3.DECODE_PROMPT, seed=0)
    routes = routed_experts(case, prompt)
    assert sorted(routes) == [i for i in range(case.spec.layers) if i not in spec_fields["mlp_only_layers"]]
    for layer, (ids, weights) in routes.items():
        used = torch.bincount(ids.reshape(-1), minlength=num_experts)
        assert int((used > 0).sum()) >= num_experts - 1, f"layer {layer} routes to {used.tolist()}"
        assert int(torch.bincount(ids[:, 0], minlength=num_experts).max()) < ids.shape[0], "one first choice"
        assert float(weights[:, 0].std()) > 0.02 and torch.allclose(weights.sum(-1), torch.ones(len(ids)))
    assert ids.shape[1] == top_k
    # One expert's weights matter: zeroing the most used expert's down projection moves the logits.
    experts = case.ours.model.layers[0].mlp.experts
    busiest = int(torch.bincount(routes[0][0].reshape(-1)).argmax())
    base = our_logits(case, prompt)
    saved = experts.down_proj[busiest].clone()
    with torch.no_grad():
        experts.down_proj[busiest].zero_()
    try:
        assert (our_logits(case, prompt) - base).abs().max() > 100 * ATOL
    finally:
        with torch.no_grad():
            experts.down_proj[busiest].copy_(saved)


def load_case(name: str, path: Path) -> q3.Qwen3VLCase:
    from tessera.models.qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration

    case = q3.load_case(name, path, SPECS)
    assert isinstance(case.ours, Qwen3VLMoeForConditionalGeneration)
    check_routing_can_fail(case)
    return case


FIXTURE = dataclasses.replace(
    q3.FIXTURE, specs=tuple(SPECS), load_case=load_case, bytes_spec="moe",
    build=lambda path, name: q3.build_tiny_qwen3_vl(path, SPECS[name]))


def make_tiny_qwen3_vl_moe_checkpoint(path: str | Path) -> Path:
    """A complete random Qwen3-VL-MoE checkpoint directory (q3.make_tiny_qwen3_vl_checkpoint's, MoE text layers)."""
    return q3.make_tiny_qwen3_vl_checkpoint(path, CHECKPOINT_SPEC)
