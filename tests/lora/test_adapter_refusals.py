"""Adapters Tessera cannot serve are refused at load with one line naming the adapter and the problem, never
loaded with a part silently ignored."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tessera.layers.lora import AdapterError, load_adapter
from tessera.models.registry import load_model
from tests.lora.lora_testing import make_adapter, make_text_checkpoint


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("lora-refusals")
    path = make_text_checkpoint(root / "base", "qwen2")
    model, config = load_model(path, torch.float32)
    mapping = type(model).weight_mapping(config)
    return root, transformers.Qwen2ForCausalLM.from_pretrained(path), model, mapping


def _load(base, adapter, max_rank=None):
    _, _, model, mapping = base
    return load_adapter("x", adapter, model, mapping, max_rank)


def _edit(path, config=None, tensors=None):
    if config is not None:
        raw = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**raw, **config}))
    if tensors is not None:
        save_file(tensors(load_file(path / "adapter_model.safetensors")), path / "adapter_model.safetensors")
    return path


def test_good_adapter_maps_onto_merged_shards(base):
    root, hf, _, _ = base
    adapter = _load(base, make_adapter(hf, root / "good", seed=1, r=4, alpha=8, targets=["k_proj", "up_proj"]))
    shards = adapter.modules["model.layers.0.self_attn.qkv_proj"]
    assert [s is not None for s in shards] == [False, True, False]  # q, k, v: only k targeted
    assert [s is not None for s in adapter.modules["model.layers.1.mlp.gate_up_proj"]] == [False, True]
    a, b = shards[1]
    assert a.shape == (4, 64) and b.shape == (32, 4)


@pytest.mark.parametrize("case,match", [
    ("embed", "LoRA on embeddings"),
    ("lm_head", "embeddings and the LM head"),
    ("dora", "DoRA"),
    ("bias", "trained biases"),
    ("modules_to_save", "modules_to_save"),
    ("rank", "above --max-lora-rank 2"),
    ("shape", "lora_A \\(4, 64\\)"),
    ("missing_b", "no lora_B"),
    ("stray", "model.norm.weight: unexpected"),
    ("not_lora", "only LORA"),
    ("no_weights", "no adapter_model.safetensors"),
])
def test_refused_with_one_line(base, case, match):
    root, hf, _, _ = base
    targets = {"embed": ["embed_tokens", "q_proj"], "lm_head": ["lm_head"]}.get(case, ["q_proj"])
    path = make_adapter(hf, root / case, seed=2, r=4, targets=targets)
    max_rank = None
    if case == "dora":
        _edit(path, {"use_dora": True})
    elif case == "bias":
        _edit(path, {"bias": "lora_only"})
    elif case == "modules_to_save":
        _edit(path, {"modules_to_save": ["lm_head"]})
    elif case == "rank":
        max_rank = 2
    elif case == "shape":
        _edit(path, {"r": 8})
    elif case == "missing_b":
        _edit(path, tensors=lambda t: {k: v for k, v in t.items() if "layers.1" not in k or "lora_B" not in k})
    elif case == "stray":
        _edit(path, tensors=lambda t: {**t, "base_model.model.model.norm.weight": torch.ones(64)})
    elif case == "not_lora":
        _edit(path, {"peft_type": "IA3"})
    elif case == "no_weights":
        (path / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match=match) as err:
        _load(base, path, max_rank)
    assert "\n" not in str(err.value) and "'x'" in str(err.value)


def test_vision_tower_targets_load_unless_the_encoder_is_data_parallel(tmp_path):
    from transformers import Qwen2VLForConditionalGeneration

    from tests.engine.conftest import make_tiny_checkpoint

    path = make_tiny_checkpoint(tmp_path / "vl", num_kv_heads=2, layers=1)
    adapter = make_adapter(Qwen2VLForConditionalGeneration.from_pretrained(path), tmp_path / "ad", seed=3,
                           targets=["q_proj", "fc1"])
    model, config = load_model(path, torch.float32)
    mapping = type(model).weight_mapping(config)
    loaded = load_adapter("x", adapter, model, mapping)
    assert "visual.blocks.0.mlp.fc1" in loaded.modules and "model.layers.0.self_attn.qkv_proj" in loaded.modules
    with pytest.raises(AdapterError, match="visual.blocks.0.mlp.fc1: LoRA on the vision tower is not supported"):
        load_adapter("x", adapter, model, mapping, encoders=False)
