"""LoRA parity with HF transformers + PEFT on more families: Qwen3 and Gemma-3 text (q/k norms, Gemma's own
block), and Qwen2-VL with an image and PEFT's "all-linear" targets (the vision tower's linears too, M-RoPE,
image embeddings merged; the base model's request beside it encodes the same image without the adapter)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tessera import Engine
from tests.lora.lora_testing import ALL_LINEARS, make_adapter, make_text_checkpoint, peft_greedy

MAX_NEW = 6
SP = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}


@pytest.mark.parametrize("arch,cls_name", [("qwen3", "Qwen3ForCausalLM"), ("gemma3", "Gemma3ForCausalLM"),
                                           ("llama4", "Llama4ForCausalLM")])  # Llama-4: the shared expert's linears
def test_text_family_matches_peft(tmp_path, arch, cls_name):
    import transformers

    cls = getattr(transformers, cls_name)
    base = make_text_checkpoint(tmp_path / "base", arch, seed=5)
    adapter = make_adapter(cls.from_pretrained(base), tmp_path / "ad", seed=6, r=4, alpha=8, targets=ALL_LINEARS)
    prompts = [[5, 17, 33, 100, 200, 7, 9], [41, 42, 43, 300, 12, 19]]
    want = [peft_greedy(base, cls, adapter, ids, MAX_NEW) for ids in prompts]
    base_want = peft_greedy(base, cls, None, prompts[0], MAX_NEW)
    assert want[0] != base_want
    with Engine(str(base), lora_paths=[f"ad={adapter}"], max_total_tokens=1024, show_progress=False) as engine:
        outs = engine.generate(input_ids=[*prompts, prompts[0]], sampling_params=SP, lora_path=["ad", "ad", None])
    assert [o["output_ids"] for o in outs] == [*want, base_want]


def test_qwen2_vl_with_image_matches_peft(tmp_path, scene_images):
    from peft import PeftModel
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    from tests.engine.conftest import make_tiny_checkpoint
    from tests.engine.hf_reference import chat_prompt

    base = make_tiny_checkpoint(tmp_path / "base", num_kv_heads=2)
    hf = Qwen2VLForConditionalGeneration.from_pretrained(base)
    # PEFT's "all-linear": the language model's linears and the vision tower's (qkv, proj, fc1, fc2, the merger's)
    adapter = make_adapter(hf, tmp_path / "ad", seed=7, r=4, alpha=8, targets="all-linear", scale=0.2)
    assert any(".visual." in k for k in load_file(adapter / "adapter_model.safetensors"))
    processor = AutoProcessor.from_pretrained(base)
    prompt = chat_prompt(processor, 1, "What color is the circle?")
    enc = processor(text=[prompt], images=[scene_images[0]], return_tensors="pt")

    def greedy(model) -> list[int]:
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
        return out[0, enc["input_ids"].shape[1]:].tolist()

    base_want = greedy(hf.eval())
    want = greedy(PeftModel.from_pretrained(Qwen2VLForConditionalGeneration.from_pretrained(base), adapter).eval())
    assert want != base_want
    with Engine(str(base), lora_paths=[f"ad={adapter}"], max_total_tokens=2048, show_progress=False) as engine:
        outs = engine.generate([prompt, prompt], SP, image_data=[[scene_images[0]], [scene_images[0]]],
                               lora_path=["ad", None])
    assert [o["output_ids"] for o in outs] == [want, base_want]
