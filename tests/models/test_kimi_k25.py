"""Kimi-K2.5 beyond the parity suite (test_family_parity.py runs prefill, decode, batches, chunks, prefix hits,
the tower and the language model alone for every spec of kimi_k25_testing.FIXTURE): Moonshot's own checkpoint
names, DeepSeek-V3's router against transformers' on many tokens, and one clear error for an inconsistent config
before any weight is read."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.models.kimi_k25_testing import SPECS, PROMPTS, KimiCase, build_tiny_kimi


def test_moonshot_checkpoint_names_load_to_the_same_model(tmp_path):
    """transformers writes the text layers as `blocks`, the patch embedding under `vision_tower.encoder` and the
    projector's norm under `model.`; Moonshot's checkpoints have `layers`, `vision_tower.patch_embed`,
    `mm_projector.pre_norm` (and may carry multi-token prediction layers, dropped). Both load to the same
    logits."""
    from tessera.models.kimi_k25 import Kimi_K25ForConditionalGeneration

    spec = SPECS["plain_tied"]
    case, _ = KimiCase.load(spec, tmp_path / "hf", build_tiny_kimi, Kimi_K25ForConditionalGeneration)
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    renames = (("language_model.model.blocks.", "language_model.model.layers."),
               ("vision_tower.encoder.patch_embed.", "vision_tower.patch_embed."),
               ("model.mm_projector.", "mm_projector."))
    moonshot = {}
    for name, t in tensors.items():
        for old, new in renames:
            name = name.replace(old, new, 1) if name.startswith(old) else name
        moonshot[name] = t
    assert moonshot.keys() != tensors.keys()
    # A multi-token prediction layer after the last decoder layer (DeepSeek-V3 ships one; nobody loads it).
    moonshot[f"language_model.model.layers.{spec.layers}.eh_proj.weight"] = torch.zeros(spec.hidden, 2 * spec.hidden)
    (tmp_path / "ms").mkdir()
    save_file(moonshot, str(tmp_path / "ms" / "model.safetensors"))
    (tmp_path / "ms" / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    from tessera.models.registry import load_model
    from tests.models.family_parity import our_logits

    ours, _ = load_model(tmp_path / "ms", torch.float32)
    prompt = case.prompt(PROMPTS["two_sizes"], seed=1)
    torch.testing.assert_close(our_logits(case, prompt, model=ours), our_logits(case, prompt), atol=0, rtol=0)


@pytest.mark.parametrize("groups,topk_group,top_k", [(4, 2, 3), (1, 1, 2), (8, 3, 4)])
def test_router_matches_transformers(groups, topk_group, top_k):
    """The chosen experts (as sets) and their weights equal DeepseekV3TopkRouter's on 300 random tokens, with a
    score bias that changes the choice."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from tessera.layers.deepseek_moe import DeepseekRouter

    cfg = DeepseekV3Config(hidden_size=24, n_routed_experts=16, n_group=groups, topk_group=topk_group,
                           num_experts_per_tok=top_k, routed_scaling_factor=2.5, norm_topk_prob=True)
    g = torch.Generator().manual_seed(groups)
    hf = DeepseekV3TopkRouter(cfg)
    hf.weight.data.normal_(0, 0.5, generator=g)
    hf.e_score_correction_bias.normal_(0, 0.3, generator=g)
    ours = DeepseekRouter(cfg)
    ours.weight.data.copy_(hf.weight)
    ours.e_score_correction_bias.data.copy_(hf.e_score_correction_bias)
    x = torch.randn(300, 24, generator=g)
    _, ref_w, ref_ids = hf(x)
    w, ids = ours(x)
    ref_order, order = ref_ids.argsort(-1), ids.argsort(-1)
    assert torch.equal(ref_ids.gather(1, ref_order), ids.gather(1, order))
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order), atol=1e-6, rtol=0)
    unbiased = torch.topk((x @ hf.weight.t()).sigmoid(), top_k, dim=-1).indices.sort(-1).values
    assert not torch.equal(unbiased, ids.sort(-1).values), "the score bias never changes the choice"


@pytest.mark.parametrize("field,value,message", [
    ("projection_hidden_size", 40, "projection_hidden_size=40 differs from vision_config.hidden_size"),
    # A text model without multi-head latent attention (transformers' own config refuses kv_lora_rank=None).
    ("text_config", {"model_type": "llama", "hidden_size": 40, "num_attention_heads": 2, "vocab_size": 128},
     "text_config.kv_lora_rank"),
])
def test_inconsistent_config_is_one_error_before_weights(tmp_path, field, value, message):
    from tessera.models.registry import load_model
    from tests.models.kimi_k25_testing import tiny_kimi_config

    cfg = tiny_kimi_config(SPECS["plain_tied"]).to_dict()
    cfg[field] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))  # no weights: the error must come first
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path, torch.float32)


def test_int8_linears_match_hf_dequantized(tmp_path, monkeypatch):
    """--torchao-config int8wo: MLA's projections and the dense and shared-expert MLPs quantized (the fused
    q_a / kv_a projection quantizes row by row, as HF's two linears do), the router and the routed experts float
    (neither is an nn.Linear in HF); an image prompt's prefill and greedy tokens equal HF's over the dequantized
    weights."""
    from tessera.layers import half_linear
    from tessera.layers.linear import Linear
    from tessera.layers.quantization.int_linear import fake_quantize_
    from tessera.models.registry import load_model
    from tests.models.family_parity import our_greedy, our_logits
    from tests.models.kimi_k25_testing import DECODE_PROMPT

    monkeypatch.setattr(half_linear, "_BF16_COMPUTE", False)  # HF multiplies the dequantized weights in float32
    spec = SPECS["yarn_qlora"]
    hf = build_tiny_kimi(tmp_path, spec)
    ours, _ = load_model(tmp_path, torch.float32, torchao_config="int8wo")
    # HF: q_a, q_b, kv_a, kv_b, o x 3 layers, gate, up, down of the dense layer and of each layer's shared experts
    assert fake_quantize_(hf, "int8wo", "model.language_model.") == 5 * 3 + 3 * 3
    assert sum(isinstance(m, Linear) and m.quantized is not None for m in ours.model.modules()) == 4 * 3 + 2 * 3
    case = KimiCase(spec, hf, ours, tmp_path)
    prompt = case.prompt(PROMPTS["two_sizes"], seed=1)
    torch.testing.assert_close(our_logits(case, prompt), case.hf_logits(prompt), atol=1e-4, rtol=0)
    decode = case.prompt(DECODE_PROMPT, seed=0)
    assert our_greedy(case, [decode], 6)[0] == [case.hf_greedy(decode, 6)[0]]


def test_attention_bias_matches_hf(tmp_path):
    """attention_bias: q_a_proj's and kv_a_proj_with_mqa's biases (one fused projection here) and o_proj's."""
    from tessera.models.registry import load_model
    from tests.models.family_parity import ATOL, our_logits

    spec = SPECS["yarn_qlora"]
    hf = build_tiny_kimi(tmp_path, spec, attention_bias=True)
    assert hf.model.language_model.layers[0].self_attn.q_a_proj.bias is not None
    ours, _ = load_model(tmp_path, torch.float32)
    case = KimiCase(spec, hf, ours, tmp_path)
    prompt = case.prompt(PROMPTS["two_sizes"], seed=1)
    torch.testing.assert_close(our_logits(case, prompt), case.hf_logits(prompt), atol=ATOL, rtol=0)
