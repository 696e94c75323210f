"""LoRA parity with HF transformers + PEFT (`PeftModel.from_pretrained`, fp32) on every image family, with an image:
PEFT's "all-linear" adapter (the language model's linears, the vision tower's, which are transformers' own
nn.Linear in most families, and the projector's) and a batch of the adapter's request, the base model's request
on the same image, and the adapter on a text-only prompt.

Each family's tiny checkpoint is its HF-parity fixture (tests/models/*_testing.py); adapter weights are large
enough that the adapter changes HF's greedy tokens, which is checked. Llama-4's MoE router and experts take no
adapter (PEFT cannot wrap its router, which returns scores and logits; experts are parameters, not linears): its
adapter leaves the router out, and both are refused at load with one line.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from safetensors.torch import load_file

from tessera import Engine
from tests.engine.hf_reference import chat_prompt
from tests.lora.lora_testing import make_adapter

MAX_NEW = 6
SP = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}

# family: (its testing module, checkpoint builder kwargs, HF loader kwargs, the vision tower's PEFT module prefix)
# and any LoraConfig extras
FAMILIES = {
    "llava": ("llava_testing", {"spec": "llama"}, {"spec": "llama"}, "model.vision_tower."),
    "llava-mistral": ("llava_testing", {"spec": "mistral"}, {"spec": "mistral"}, "model.vision_tower."),
    "llava_next": ("llava_testing", {"spec": "next_llama"}, {"spec": "next_llama"}, "model.vision_tower."),
    "internvl": ("internvl_testing", {"max_patches": 2}, {}, "model.vision_tower."),
    "pixtral": ("pixtral_testing", {}, {}, "model.vision_tower."),
    "qwen2_5_vl": ("qwen2_5_vl_testing", {}, {}, "model.visual."),
    "qwen3_vl": ("qwen3_vl_testing", {}, {}, "model.visual."),
    "qwen3_vl_moe": ("qwen3_vl_moe_testing", {}, {}, "model.visual."),  # attention, dense MLP (not the experts)
    "gemma3": ("gemma3_testing", {}, {}, "model.vision_tower."),
    "gemma4": ("gemma4_testing", {}, {}, "model.vision_tower."),
    "glm4v": ("glm4v_testing", {}, {}, "model.visual."),
    "llama4": ("llama4_testing", {}, {}, "vision_model.", {"exclude_modules": ["router"]}),
    "cosmos3_edge": ("cosmos3_testing", {}, {}, "model.visual."),
    "mllama": ("mllama_testing", {}, {}, "model.vision_model."),
    # MLA's projections (q_a_proj and kv_a_proj_with_mqa into one fused matmul), dense and shared-expert MLPs; the
    # DeepSeek router and the routed experts are not linears, so PEFT's all-linear leaves them out.
    "kimi_k25": ("kimi_k25_testing", {}, {}, "model.vision_tower."),
}


def family_checkpoint(family: str, path):
    """(the tiny checkpoint at `path`, a loader of HF's model over it)."""
    name, build_kw, load_kw = FAMILIES[family][:3]
    module = importlib.import_module(f"tests.models.{name}")
    builder = next(getattr(module, f) for f in dir(module) if f.startswith("make_tiny_") and f.endswith("_checkpoint"))
    path = builder(path, **build_kw)
    return path, lambda: module.load_hf_reference(path, **load_kw)


def prompt_of(family: str, processor, num_images: int, text: str) -> str:
    # Pixtral's template has no add_generation_prompt flag (HF's docs call it without)
    return chat_prompt(processor, num_images, text, add_generation_prompt=family != "pixtral")


@torch.no_grad()
def hf_greedy(model, processor, prompt: str, images) -> list[int]:
    # M-RoPE families' generate reads the token types, which some processors (Cosmos3-Edge's) return only when asked.
    asked = {"return_mm_token_type_ids": True} if "mm_token_type_ids" in processor.model_input_names else {}
    enc = processor(text=[prompt], return_tensors="pt", **asked, **({"images": images} if images else {}))
    if "pixel_values" in enc:  # Llama-4's image processor gives bfloat16 pixels
        enc["pixel_values"] = enc["pixel_values"].float()
    out = model.generate(**enc, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, enc["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_all_linear_adapter_with_an_image_matches_peft(family, tmp_path, scene_images):
    from peft import PeftModel
    from transformers import AutoProcessor

    path, load_hf = family_checkpoint(family, tmp_path / "base")
    hf = load_hf()
    tower, *extra = FAMILIES[family][3:]
    adapter = make_adapter(hf, tmp_path / "ad", seed=7, r=4, alpha=8, targets="all-linear", scale=0.2,
                           **(extra[0] if extra else {}))
    assert any(k.startswith(f"base_model.model.{tower}") for k in load_file(adapter / "adapter_model.safetensors"))
    processor = AutoProcessor.from_pretrained(path)
    image = [scene_images[0]]
    prompt = prompt_of(family, processor, 1, "What color is the circle?")
    text = prompt_of(family, processor, 0, "Hello there, how are you?")
    base_want = hf_greedy(hf, processor, prompt, image)
    peft = PeftModel.from_pretrained(load_hf(), adapter).eval()
    want, text_want = (hf_greedy(peft, processor, p, ims) for p, ims in ((prompt, image), (text, None)))
    assert want != base_want, "the adapter must change HF's tokens"
    with Engine(str(path), lora_paths=[f"ad={adapter}"], page_size=4, max_total_tokens=4096,
                show_progress=False) as engine:
        outs = engine.generate([prompt, prompt, text], SP, image_data=[image, image, None],
                               lora_path=["ad", None, "ad"])
    assert [o["output_ids"] for o in outs] == [want, base_want, text_want]


def test_llama4_router_and_experts_are_refused_at_load(tmp_path):
    from tessera.layers.lora import AdapterError, load_adapter
    from tessera.models.registry import load_model
    from tests.lora.test_adapter_refusals import _edit

    path, load_hf = family_checkpoint("llama4", tmp_path / "base")
    model, config = load_model(path, torch.float32)
    mapping = type(model).weight_mapping(config)
    adapter = make_adapter(load_hf(), tmp_path / "router", seed=1, targets=["router", "q_proj"])
    with pytest.raises(AdapterError, match=r"layers\.1\.feed_forward\.router: LoRA on the MoE router is not supported"):
        load_adapter("x", adapter, model, mapping)
    _edit(adapter, {"target_parameters": ["feed_forward.experts.gate_up_proj"]})
    with pytest.raises(AdapterError, match="target_parameters: LoRA on parameters \\(MoE experts\\) is not supported"):
        load_adapter("x", adapter, model, mapping)


def test_tower_layers_other_than_linears_are_refused_at_load(tmp_path):
    """PEFT makes conv adapters too (CLIP's patch embedding): refused, naming the module and its type."""
    from tessera.layers.lora import AdapterError, load_adapter
    from tessera.models.registry import load_model

    path, load_hf = family_checkpoint("llava", tmp_path / "base")
    model, config = load_model(path, torch.float32)
    adapter = make_adapter(load_hf(), tmp_path / "conv", seed=1, targets=["patch_embedding", "q_proj"])
    with pytest.raises(AdapterError, match=r"patch_embedding: LoRA on Conv2d is not supported \(only on linear"):
        load_adapter("x", adapter, model, type(model).weight_mapping(config))
