"""The bundled demo adapter (tessera/assets/lora/demo-vl-unsure) over the bundled demo-vl: named by its bare
name in lora_paths, it makes demo-vl's answers unsure ("blue?"), with the greedy tokens of HF
transformers + PEFT over the same files (a real trained adapter on a real checkpoint, with an image)."""

from __future__ import annotations

import torch

from tessera import Engine
from tessera.config import ASSETS_DIR, BUNDLED_LORA_DIR

ADAPTER = BUNDLED_LORA_DIR / "demo-vl-unsure"
IMAGE = ASSETS_DIR / "examples" / "scene.png"


def test_demo_adapter_answers_in_sentences_as_peft_does():
    from peft import PeftModel
    from PIL import Image
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    base = ASSETS_DIR / "demo-vl"
    assert (ADAPTER / "adapter_model.safetensors").stat().st_size < 2_000_000  # small enough to ship
    processor = AutoProcessor.from_pretrained(base)
    questions = ["What color is the square?", "How many shapes are there?", "Describe the image."]
    prompts = [processor.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
                                             add_generation_prompt=True, tokenize=False) for q in questions]
    image = Image.open(IMAGE).convert("RGB")
    model = PeftModel.from_pretrained(Qwen2VLForConditionalGeneration.from_pretrained(base), ADAPTER).eval()
    want = []
    with torch.no_grad():
        for p in prompts:
            enc = processor(text=[p], images=[image], return_tensors="pt")
            out = model.generate(**enc, max_new_tokens=16, do_sample=False)
            want.append(processor.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    with Engine("demo-vl", lora_paths=["demo-vl-unsure"], show_progress=False) as engine:
        outs = engine.generate(prompts + prompts[:1], {"temperature": 0, "max_new_tokens": 16},
                               image_data=[str(IMAGE)] * 4, lora_path=["demo-vl-unsure"] * 3 + [None])
    assert [o["text"] for o in outs[:3]] == want
    assert want[0] == "blue?" and outs[3]["text"] == "blue"
