"""Cosmos3 beyond the parity suite: the unified checkpoint as a Diffusers pipeline (--model-type llm), its
Generator's tensors skipped, and a config without its vision tower's refused by name before any weight loads."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.config import ServerArgs
from tessera.models.config import ModelConfig
from tessera.models.registry import load_model
from tests.models.cosmos3_testing import EDGE_SPECS, as_diffusers_layout, build_tiny_cosmos3_edge


def test_diffusers_layout_serves_the_understanding_tower_with_model_type_llm(tmp_path):
    hf = build_tiny_cosmos3_edge(tmp_path, EDGE_SPECS["mha_tied"])
    as_diffusers_layout(tmp_path)
    with pytest.raises(ValueError, match="model_index.json.*--model-type llm"):
        ServerArgs(model_path=str(tmp_path))
    with pytest.raises(ValueError, match="model_type: expected auto or llm.*no diffusion runtime"):
        ServerArgs(model_path=str(tmp_path), model_type="diffusion")
    assert ServerArgs(model_path=str(tmp_path), model_type="llm").model_type == "llm"
    ours, _ = load_model(tmp_path)  # from transformer/, the Generator's tensors dropped
    torch.testing.assert_close(ours.lm_head.weight, hf.lm_head.weight)
    torch.testing.assert_close(ours.model.layers[1].self_attn.qkv_proj.weight[:20],
                               hf.model.language_model.layers[1].self_attn.q_proj.weight[:20])
    text_only, _ = load_model(tmp_path, language_model_only=True)
    assert text_only.visual is None and text_only.projector is None


def test_missing_vision_config_is_named_before_weights_load(tmp_path):
    build_tiny_cosmos3_edge(tmp_path, EDGE_SPECS["mha_tied"])
    config = json.loads((tmp_path / "config.json").read_text())
    del config["vision_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").unlink()  # nothing may be read past the config
    with pytest.raises(ValueError, match="Cosmos3EdgeForConditionalGeneration checkpoint lacks vision_config"):
        ModelConfig.load(tmp_path)


def test_int8_weights_match_hf_dequantized(tmp_path, monkeypatch):
    """--torchao-config int8wo quantizes Edge's decoder linears (the ungated MLP's fc1/fc2 too): our logits on an image
    and video prompt equal HF's over the same weights dequantized."""
    from tessera.layers import half_linear
    from tessera.layers.quantization.int_linear import fake_quantize_
    from tests.models.cosmos3_testing import Cosmos3EdgeCase
    from tests.models.family_parity import ATOL, our_logits
    from tests.models.qwen3_vl_testing import DECODE_PROMPT

    monkeypatch.setattr(half_linear, "_BF16_COMPUTE", False)  # HF multiplies the dequantized weights in float32
    spec = EDGE_SPECS["gqa"]
    hf = build_tiny_cosmos3_edge(tmp_path, spec)
    ours, _ = load_model(tmp_path, torch.float32, torchao_config="int8wo")
    assert ours.model.layers[0].mlp.fc1.quantized is not None and ours.model.layers[0].mlp.fc2.quantized is not None
    case = Cosmos3EdgeCase(spec, hf, ours, tmp_path)
    prompt = case.prompt(DECODE_PROMPT, seed=2)
    before = case.hf_logits(prompt)
    assert fake_quantize_(hf, "int8wo", "model.language_model.") == 6 * spec.layers  # q, k, v, o, fc1, fc2
    ref = case.hf_logits(prompt)
    assert (ref - before).abs().max() > 1e-3  # the quantization changes the model
    torch.testing.assert_close(our_logits(case, prompt), ref, atol=ATOL, rtol=0)
