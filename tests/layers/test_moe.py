"""The shared grouped expert computation (layers/moe.grouped_experts) against a naive per-token reference, with
the routing weight on each expert's output (Qwen) and on its input (Llama-4); the stacked experts' loading
(transformers' in-memory layout, tensor-parallel shards); the Qwen router's renormalised softmax top-k."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.layers import moe
from tessera.layers.linear import count_parameters
from tessera.layers.moe import SoftmaxTopKMoE, StackedExperts, grouped_experts


def naive_moe(x, w13, w2, ids, weights, act, weights_on_input):
    """One token, one slot at a time: sum_j w_j * expert_j(x) or sum_j expert_j(w_j * x)."""
    out = torch.zeros_like(x)
    inter = w2.shape[1]
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t]):
            xin = x[t] * w if weights_on_input else x[t]
            h = xin @ w13[e]
            gate, up = h[:inter], h[inter:]
            a = (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up
            y = a @ w2[e]
            out[t] += y if weights_on_input else w * y
    return out


def random_moe(num_tokens, num_experts, hidden, inter, top_k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g)
    w13 = torch.randn(num_experts, hidden, 2 * inter, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, inter, hidden, generator=g) / inter**0.5
    # The last expert never chosen: an empty group in the middle of the grouped products' offsets.
    ids = torch.stack([torch.randperm(num_experts - 1, generator=g)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=g)
    return x, w13, w2, ids, weights


@pytest.mark.parametrize("weights_on_input", [False, True], ids=["weights-on-output", "weights-on-input"])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (7, 1), (33, 3)])
def test_grouped_experts_match_a_per_token_reference(weights_on_input, act, num_tokens, top_k) -> None:
    x, w13, w2, ids, weights = random_moe(num_tokens, 6, 24, 10, top_k)
    want = naive_moe(x, w13, w2, ids, weights, act, weights_on_input)
    got = grouped_experts(x, w13, w2, ids, weights, act, weights_on_input=weights_on_input)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # `out` accumulates (a shared expert's output), and the per-expert fallback gives the same sums.
    base = torch.randn_like(x)
    torch.testing.assert_close(grouped_experts(x, w13, w2, ids, weights, act, weights_on_input=weights_on_input,
                                               out=base.clone()), base + want, atol=1e-5, rtol=1e-5)


def test_the_loop_fallback_equals_the_grouped_matmul(monkeypatch) -> None:
    x, w13, w2, ids, weights = random_moe(19, 5, 16, 12, 2, seed=3)
    grouped = grouped_experts(x, w13, w2, ids, weights)
    monkeypatch.delattr(torch, "_grouped_mm", raising=False)
    torch.testing.assert_close(grouped_experts(x, w13, w2, ids, weights), grouped, atol=1e-6, rtol=1e-6)


def test_mismatched_routing_shapes_are_refused() -> None:
    x, w13, w2, ids, weights = random_moe(4, 4, 8, 4, 2)
    with pytest.raises(ValueError, match="topk_ids"):
        grouped_experts(x, w13, w2, ids, weights[:, :1])
    assert grouped_experts(x[:0], w13, w2, ids[:0], weights[:0]).shape == (0, 8)


def test_stacked_experts_load_either_layout_and_their_tensor_parallel_share(monkeypatch) -> None:
    E, H, I = 3, 8, 6
    on_disk_13, on_disk_2 = torch.randn(E, H, 2 * I), torch.randn(E, I, H)
    experts = StackedExperts(E, H, I, "silu", linear_layout=True)
    experts.load_param("gate_up_proj", on_disk_13.transpose(1, 2).contiguous())  # transformers' [E, 2I, H]
    experts.load_param("down_proj", on_disk_2)
    assert torch.equal(experts.gate_up_proj, on_disk_13) and torch.equal(experts.down_proj, on_disk_2)
    with pytest.raises(ValueError, match="want"):
        experts.load_param("down_proj", torch.randn(E, I, H + 1))
    with pytest.raises(ValueError, match="want"):  # Llama-4's experts take only their own layout
        StackedExperts(E, H, I, "silu").load_param("down_proj", on_disk_2.transpose(1, 2))
    # Rank 1 of 2: columns 3..5 of gate and of up, rows 3..5 of down; the ranks' partial sums add up.
    x, _, _, ids, weights = random_moe(5, E + 1, H, I, 2)
    ids = ids % E
    full = grouped_experts(x, on_disk_13, on_disk_2, ids, weights)
    parts = []
    for rank in (0, 1):
        monkeypatch.setattr(moe, "tp_group", lambda rank=rank: _group(rank))
        share = StackedExperts(E, H, I, "silu")
        share.load_param("gate_up_proj", on_disk_13)
        share.load_param("down_proj", on_disk_2)
        assert share.gate_up_proj.shape == (E, H, I)
        assert torch.equal(share.down_proj, on_disk_2[:, 3 * rank:3 * rank + 3])
        parts.append(share(x, ids, weights))
        assert count_parameters(share, 2) == on_disk_13.numel() + on_disk_2.numel()
    torch.testing.assert_close(parts[0] + parts[1], full, atol=1e-5, rtol=1e-5)


def _group(rank: int):
    from tessera.distributed.parallel_state import TPGroup

    return TPGroup(rank, 2)


def test_softmax_router_renormalises_the_top_k_like_transformers() -> None:
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeTextTopKRouter
    from transformers import Qwen3VLMoeTextConfig

    cfg = Qwen3VLMoeTextConfig(hidden_size=16, num_experts=6, num_experts_per_tok=3)
    hf = Qwen3VLMoeTextTopKRouter(cfg)
    ours = SoftmaxTopKMoE(16, 8, 6, 3, "silu")
    with torch.no_grad():
        hf.weight.copy_(torch.randn(6, 16))
        ours.gate.weight.copy_(hf.weight)
    x = torch.randn(9, 16)
    _, hf_weights, hf_ids = hf(x)
    ids, weights = ours.route(x)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights)
    torch.testing.assert_close(weights.sum(-1), torch.ones(9))


@pytest.mark.parametrize("step,dense", [(1, []), (2, [3]), (3, [0, 2])])
def test_qwen3_vl_moe_sparse_layers_are_transformers(step, dense) -> None:
    from transformers import Qwen3VLMoeTextConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import (
        Qwen3VLMoeTextDecoderLayer,
        Qwen3VLMoeTextSparseMoeBlock,
    )

    from tessera.models.qwen3_vl_moe import moe_layer_ids

    cfg = Qwen3VLMoeTextConfig(hidden_size=8, intermediate_size=8, moe_intermediate_size=4, num_experts=2,
                               num_experts_per_tok=1, num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                               decoder_sparse_step=step, mlp_only_layers=dense)
    want = {i for i in range(6) if isinstance(Qwen3VLMoeTextDecoderLayer(cfg, i).mlp, Qwen3VLMoeTextSparseMoeBlock)}
    assert moe_layer_ids(cfg) == want and want
