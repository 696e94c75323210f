"""Weight loading: both checkpoint naming schemes, shards, error listings, language-model-only."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from qwen2_vl_testing import build_prompt, hf_positions, prompt_mm_embeds
from paged_driver import PagedKV, Step, make_batch
from safetensors import safe_open
from safetensors.torch import save_file

from tessera.models.registry import get_model_class, load_model
from tessera.models.weights import WeightLoadError
from tessera.platform.device import compute_dtype

pytestmark = pytest.mark.parametrize("vl_case", ["gqa"], indirect=True)


def rewrite_checkpoint(src: str, dst: Path, rename=lambda n: n, drop: tuple[str, ...] = (),
                       extra: dict[str, torch.Tensor] | None = None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(src) / "config.json", dst / "config.json")
    with safe_open(str(Path(src) / "model.safetensors"), "pt") as f:
        tensors = {rename(k): f.get_tensor(k) for k in f.keys() if k not in drop}
    save_file({**tensors, **(extra or {})}, str(dst / "model.safetensors"))
    return dst


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def to_v5_name(name: str) -> str:
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model."):
        return "model.language_model." + name[len("model."):]
    return name


def test_transformers5_names_load_identically(vl_case, tmp_path):
    path = rewrite_checkpoint(vl_case.path, tmp_path / "v5", rename=to_v5_name)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert "model.language_model.layers.0.self_attn.q_proj.weight" in f.keys()
        assert "model.visual.blocks.0.attn.qkv.weight" in f.keys()
    model, _ = load_model(path, torch.float32)
    assert_same_weights(model, vl_case.ours)


def test_sharded_checkpoint_loads(vl_case, tmp_path):
    vl_case.hf.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model, _ = load_model(tmp_path, torch.float32)
    assert_same_weights(model, vl_case.ours)


def test_fused_shards_hold_the_checkpoint_tensors(vl_case):
    attn = vl_case.ours.model.layers[1].self_attn
    ref = vl_case.hf.model.language_model.layers[1].self_attn
    q, k, v = attn.qkv_proj.split(attn.qkv_proj.bias)
    assert torch.equal(q, ref.q_proj.bias) and torch.equal(k, ref.k_proj.bias) and torch.equal(v, ref.v_proj.bias)


def test_missing_and_unexpected_weights_are_listed(vl_case, tmp_path):
    path = rewrite_checkpoint(vl_case.path, tmp_path / "bad", drop=("model.layers.1.self_attn.k_proj.bias",),
                              extra={"model.layers.0.mystery.weight": torch.zeros(2)})
    with pytest.raises(WeightLoadError) as err:
        load_model(path, torch.float32)
    msg = str(err.value)
    assert "missing (1)" in msg and "model.layers.1.self_attn.qkv_proj.bias[k]" in msg
    assert "unexpected (1)" in msg and "model.layers.0.mystery.weight" in msg


def test_shape_mismatch_is_reported(vl_case, tmp_path):
    path = rewrite_checkpoint(vl_case.path, tmp_path / "shape", drop=("model.norm.weight",),
                              extra={"model.norm.weight": torch.ones(3)})
    with pytest.raises(WeightLoadError, match="model.norm.weight: checkpoint \\(3,\\)"):
        load_model(path, torch.float32)


def test_language_model_only_skips_the_vision_tower(vl_case):
    model, _ = load_model(vl_case.path, torch.float32, language_model_only=True)
    assert model.visual is None
    assert not any(n.startswith("visual.") for n in model.state_dict())
    prompt = build_prompt([10], seed=9)
    outs = []
    for m in (model, vl_case.ours):
        kv = PagedKV(m.lm_config)
        step = Step(kv.new_request(), prompt.input_ids, torch.arange(10).expand(3, -1), all_logits=True)
        with torch.inference_mode():
            outs.append(m(make_batch(kv, [step]), kv.pool))
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="language_model_only"):
        model.get_image_feature(build_prompt([1, ("image", (1, 2, 2))]).items)


def test_bfloat16_load_and_forward(vl_case):
    model, _ = load_model(vl_case.path, "bfloat16")
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    # The tower's linears are bf16 too; on a CPU the rest computes in float32 (compute_dtype), on CUDA in bf16.
    run = compute_dtype(torch.bfloat16, "cpu")
    assert model.visual.blocks[0].mlp.fc1.weight.dtype == torch.bfloat16 and model.visual.inv_freq.dtype == torch.float32
    assert model.visual.patch_embed.proj.weight.dtype == model.model.norm.weight.dtype == run
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    prompt = build_prompt([3, ("image", (1, 4, 4)), 2], seed=10)
    outs = []
    for m, dtype in ((model, run), (vl_case.ours, torch.float32)):
        kv = PagedKV(m.lm_config, dtype=dtype)
        with torch.inference_mode():
            rows, embeds = prompt_mm_embeds(m, prompt)
            step = Step(kv.new_request(), prompt.input_ids, hf_positions(vl_case.hf, prompt)[0], rows, embeds)
            outs.append(m(make_batch(kv, [step]), kv.pool).float())
    assert outs[0].dtype == torch.float32 and (outs[0] - outs[1]).abs().max() < 0.1


def test_unknown_architecture_is_refused(vl_case):
    with pytest.raises(ValueError, match="not supported"):
        get_model_class("LlamaForCausalLM")
