"""Adapters over a quantized base (QLoRA-style serving): --torchao-config int8wo weights with an adapter give
the greedy tokens of HF + PEFT over the same weights quantized and dequantized (int_linear.fake_quantize_); and
over tensor-parallel ranks."""

from __future__ import annotations

import pytest
import torch

from tessera import Engine
from tessera.layers.quantization.int_linear import fake_quantize_
from tests.lora.lora_testing import ALL_LINEARS, make_adapter, make_text_checkpoint, peft_greedy
from tests.models.quant_fixtures import Scheme

PROMPTS = [[5, 17, 33, 100, 200, 7, 9], [41, 42, 43, 300, 12, 19]]


@pytest.mark.slow
def test_adapter_over_int8_weights_matches_peft(tmp_path):
    import transformers
    from peft import PeftModel

    base = make_text_checkpoint(tmp_path / "base", "qwen2", seed=21)
    adapter = make_adapter(transformers.Qwen2ForCausalLM.from_pretrained(base), tmp_path / "ad", seed=22, r=4,
                           targets=ALL_LINEARS)
    hf = transformers.Qwen2ForCausalLM.from_pretrained(base, attn_implementation="eager").eval()
    assert fake_quantize_(hf, "int8wo", "model.") == 2 * 7
    model = PeftModel.from_pretrained(hf, adapter).eval()
    want = []
    with torch.no_grad():
        for ids in PROMPTS:
            t = torch.tensor([ids])
            out = model.generate(input_ids=t, attention_mask=torch.ones_like(t), max_new_tokens=6, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
            want.append(out[0, len(ids):].tolist())
    sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    with Engine(str(base), torchao_config="int8wo", lora_paths=[f"ad={adapter}"], max_total_tokens=1024,
                show_progress=False) as engine:
        assert "int8" in engine.get_server_info()["effective"]["quantization"]
        outs = engine.generate(input_ids=PROMPTS, sampling_params=sp, lora_path=["ad", "ad"])
    assert [o["output_ids"] for o in outs] == want


@pytest.mark.slow
def test_adapter_under_tensor_parallelism_matches_peft(tmp_path):
    """Two ranks (gloo): column-parallel shards keep their rows of B, the row-parallel O and down projections
    their columns of A (summed in the base layer's all-reduce)."""
    import transformers

    base = make_text_checkpoint(tmp_path / "base", "qwen2", seed=23)
    adapter = make_adapter(transformers.Qwen2ForCausalLM.from_pretrained(base), tmp_path / "ad", seed=24, r=4,
                           targets=ALL_LINEARS)
    want = [peft_greedy(base, transformers.Qwen2ForCausalLM, a, PROMPTS[0], 6) for a in (adapter, None)]
    sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    with Engine(str(base), tp_size=2, lora_paths=[f"ad={adapter}"], max_total_tokens=1024,
                show_progress=False) as engine:
        outs = engine.generate(input_ids=[PROMPTS[0]] * 2, sampling_params=sp, lora_path=["ad", None])
    assert [o["output_ids"] for o in outs] == want


@pytest.mark.parametrize("scheme", [Scheme("awq"), Scheme("ct-fp8")], ids=["awq-4bit-g32", "ct-fp8-channel"])
def test_adapter_over_a_pre_quantized_checkpoint_matches_peft(tmp_path, scheme):
    """A pre-quantized checkpoint (AWQ int4 on our int kernels; compressed-tensors FP8, dequantized at load) with
    an adapter gives HF + PEFT's greedy tokens over the same weights dequantized (tests/models/quant_fixtures)."""
    import shutil

    import transformers

    from tessera.config import ASSETS_DIR
    from tests.models.quant_fixtures import quantize_checkpoint, save_tiny_qwen3

    src = tmp_path / "float"
    src.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ASSETS_DIR / "demo-vl" / f, src / f)
    save_tiny_qwen3(src)
    quantized, ref = tmp_path / "quantized", tmp_path / "reference"
    quantize_checkpoint(src, quantized, ref, scheme, ["lm_head"])
    cls = transformers.Qwen3ForCausalLM
    adapter = make_adapter(cls.from_pretrained(ref), tmp_path / "ad", seed=31, r=4, targets=ALL_LINEARS)
    want = [peft_greedy(ref, cls, adapter, ids, 6) for ids in PROMPTS]
    assert want[0] != peft_greedy(ref, cls, None, PROMPTS[0], 6)
    sp = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    with Engine(str(quantized), lora_paths=[f"ad={adapter}"], max_total_tokens=1024, show_progress=False) as engine:
        assert engine.get_server_info()["effective"]["quantization"]
        outs = engine.generate(input_ids=PROMPTS, sampling_params=sp, lora_path=["ad", "ad"])
    assert [o["output_ids"] for o in outs] == want
