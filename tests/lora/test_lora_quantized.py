"""Adapters over a quantized base (QLoRA-style serving): --torchao-config int8wo weights with an adapter give
the greedy tokens of HF + PEFT over the same weights quantized and dequantized (int_linear.fake_quantize_); and
over tensor-parallel ranks."""

from __future__ import annotations

import pytest
import torch

from tessera import Engine
from tessera.layers.quantization.int_linear import fake_quantize_
from tests.lora.lora_testing import ALL_LINEARS, make_adapter, make_text_checkpoint, peft_greedy

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
