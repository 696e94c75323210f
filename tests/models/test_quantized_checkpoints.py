"""Pre-quantized checkpoints of a text family (Qwen3), every scheme: our model loaded from the quantized
checkpoint gives HF's fp32 prefill logits (1e-4) and greedy tokens, HF running the same checkpoint dequantized
(its float config with the weights the quantized tensors stand for). The fixtures are what their tools' readers
take them for: transformers, reading a compressed-tensors (or HF fp8) fixture through its own quantizer, gets
exactly that reference (needs compressed-tensors, a test dependency; HF's fp8 reader needs accelerate). AWQ and
GPTQ have no CPU reader in transformers (it needs gptqmodel): their packing follows the tools' code, checked in
tests/layers/test_checkpoint_formats.py. Unsupported schemes and an ignore list the checkpoint contradicts fail
at load, naming what is wrong."""

from __future__ import annotations

import json

import pytest
import torch
from paged_driver import check_text_prefill_and_decode

from tessera.models.quant_config import UnsupportedQuantizationError
from tessera.models.registry import load_model
from tessera.models.weights import WeightLoadError
from tests.models.quant_fixtures import Scheme, check_quantization_report, quantize_checkpoint, save_tiny_qwen3

SCHEMES = {  # name: (scheme, what the model reports)
    "awq-4bit-g32": (Scheme("awq"), "awq 4-bit g32 asym"),
    "gptq-4bit-g32-asym-v1": (Scheme("gptq"), "gptq 4-bit g32 asym"),
    "gptq-8bit-g32-sym-v2": (Scheme("gptq", bits=8, symmetric=True, v2=True), "gptq 8-bit g32 sym"),
    "ct-w4a16-g32-sym": (Scheme("ct-pack", symmetric=True), "compressed-tensors pack-quantized 4-bit g32 sym"),
    "ct-w4a16-g32-asym": (Scheme("ct-pack"), "compressed-tensors pack-quantized 4-bit g32 asym"),
    "ct-w8a16-channel-asym": (Scheme("ct-pack", bits=8, group=None),
                              "compressed-tensors pack-quantized 8-bit per-channel asym"),
    "ct-naive-int8-sym": (Scheme("ct-naive", bits=8, group=None, symmetric=True),
                          "compressed-tensors naive-quantized 8-bit per-channel sym"),
    "ct-fp8-channel": (Scheme("ct-fp8"), "compressed-tensors fp8 per-channel, dynamic activations"),
    "ct-fp8-tensor": (Scheme("ct-fp8", strategy="tensor"), "compressed-tensors fp8 per-tensor, dynamic activations"),
    "fp8-block32": (Scheme("fp8-block"), "fp8 block 32x32, dynamic activations"),
}


@pytest.fixture(scope="module")
def float_qwen3(tmp_path_factory):
    return save_tiny_qwen3(tmp_path_factory.mktemp("qwen3-float"))


def _build(tmp_path_factory, src, name: str, scheme: Scheme):
    root = tmp_path_factory.mktemp(name)
    ignore = ["lm_head"] if scheme.method.startswith("ct") else ["lm_head", "visual"]
    modules = quantize_checkpoint(src, root / "quantized", root / "reference", scheme, ignore)
    return root / "quantized", root / "reference", modules


@pytest.mark.parametrize("name", list(SCHEMES))
def test_quantized_qwen3_matches_hf_dequantized(name, float_qwen3, tmp_path_factory):
    from transformers import Qwen3ForCausalLM

    scheme, reported = SCHEMES[name]
    path, ref, modules = _build(tmp_path_factory, float_qwen3, name, scheme)
    hf = Qwen3ForCausalLM.from_pretrained(ref, attn_implementation="eager").eval()
    float_weights = Qwen3ForCausalLM.from_pretrained(float_qwen3).state_dict()
    assert all(not torch.equal(hf.state_dict()[m + ".weight"], float_weights[m + ".weight"]) for m in modules)
    ours, config = load_model(path, torch.float32)
    assert config.quant is not None and config.quant.ignores("lm_head")
    check_quantization_report(ours.quantization, reported)
    ids = torch.randint(1, 128, (13,), generator=torch.Generator().manual_seed(2))
    _, tokens = check_text_prefill_and_decode(hf, ours, ids, 10)
    assert len(set(tokens)) >= 3, f"greedy output {tokens} is (nearly) one repeated token"


@pytest.mark.parametrize("name", [n for n, (s, _) in SCHEMES.items() if s.method.startswith("ct") or "fp8" in s.method])
def test_transformers_reads_fixture_as_reference(name, float_qwen3, tmp_path_factory):
    from transformers import Qwen3ForCausalLM

    scheme, _ = SCHEMES[name]
    kwargs = {}
    if scheme.method == "fp8-block":
        pytest.importorskip("accelerate")
    else:
        pytest.importorskip("compressed_tensors")
        from transformers import CompressedTensorsConfig

        kwargs["quantization_config"] = CompressedTensorsConfig(dequantize=True)
    path, ref, _ = _build(tmp_path_factory, float_qwen3, f"hf-{name}", scheme)
    theirs = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).state_dict()
    ours = Qwen3ForCausalLM.from_pretrained(ref).state_dict()
    assert theirs.keys() == ours.keys()
    assert [k for k in ours if not torch.equal(theirs[k], ours[k])] == []


def _edit(path, update) -> None:
    config = json.loads((path / "config.json").read_text())
    update(config["quantization_config"])
    (path / "config.json").write_text(json.dumps(config))


def test_unsupported_scheme_and_contradicted_ignore_list_are_refused(float_qwen3, tmp_path_factory):
    path, _, _ = _build(tmp_path_factory, float_qwen3, "refused-gptq", Scheme("gptq"))
    _edit(path, lambda q: q.update(desc_act=True))
    with pytest.raises(UnsupportedQuantizationError, match=r"gptq desc_act true .*; supported: compressed-tensors"):
        load_model(path)
    _edit(path, lambda q: q.update(desc_act=False, bits=3))
    with pytest.raises(UnsupportedQuantizationError, match="gptq bits 3 is not supported"):
        load_model(path)
    _edit(path, lambda q: q.update(bits=4, modules_to_not_convert=["lm_head", "layers.1.mlp"]))
    with pytest.raises(WeightLoadError, match=r"module model\.layers\.1\.mlp\.\w+_proj is in the .* ignore list"):
        load_model(path)
    ct, _, _ = _build(tmp_path_factory, float_qwen3, "refused-ct", Scheme("ct-naive", bits=8, group=None))
    _edit(ct, lambda q: q["config_groups"]["group_0"].update(input_activations={
        "num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}))
    with pytest.raises(UnsupportedQuantizationError, match="with int8 activation quantization is not supported"):
        load_model(ct)


def _ct(weights: dict, acts: dict | None = None, fmt: str = "pack-quantized", **extra) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": acts, "format": fmt}
    return {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"group_0": group}, **extra}


INT4 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}
FP8 = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}


@pytest.mark.parametrize("qc,refused", [
    ({"quant_method": "awq", "version": "gemv", "bits": 4, "group_size": 128}, "awq version 'gemv'"),
    ({"quant_method": "awq", "version": "gemm", "bits": 4, "zero_point": False}, "awq zero_point false"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "gptq checkpoint_format 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "is_marlin_format": True}, "gptq checkpoint_format 'marlin'"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]},
     "fp8 activation_scheme 'static'"),
    (_ct(FP8, {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}, "float-quantized"),
     "compressed-tensors float-quantized float8 channel with static activation scales"),
    (_ct(INT4, fmt="marlin-24"), "compressed-tensors marlin-24 int4 group"),
    (_ct(INT4, kv_cache_scheme={"num_bits": 8, "type": "float"}), "compressed-tensors kv_cache_scheme"),
    (_ct({**INT4, "actorder": "group"}), "compressed-tensors pack-quantized int4 group actorder group (g_idx)"),
])
def test_unsupported_configs_name_the_scheme(qc, refused):
    from types import SimpleNamespace

    from tessera.models.quant_config import QuantConfig

    with pytest.raises(UnsupportedQuantizationError) as e:
        QuantConfig.from_hf(SimpleNamespace(quantization_config=qc))
    assert f"quantization_config: {refused}" in str(e.value) and "\n" not in str(e.value)


def test_ignore_lists_match_as_their_tools_do():
    from types import SimpleNamespace

    from tessera.models.quant_config import QuantConfig

    ct = QuantConfig.from_hf(SimpleNamespace(quantization_config=_ct(INT4, ignore=["lm_head", "re:.*visual.*"])))
    assert ct.ignores("lm_head") and ct.ignores("model.visual.blocks.0.mlp.fc1")
    assert not ct.ignores("model.layers.0.mlp.down_proj") and not ct.ignores("model.lm_head_extra")
    awq = QuantConfig.from_hf(SimpleNamespace(quantization_config={
        "quant_method": "awq", "bits": 4, "group_size": 64, "modules_to_not_convert": ["visual"]}))
    assert awq.ignores("model.visual.merger.mlp.0") and not awq.ignores("lm_head") and awq.group_size == 64
