"""Pixtral against transformers through a complete checkpoint and the real processor. The model parity tests
(prefill, decode, batches, chunks, prefix hits, the tower, the language model alone) run for every Pixtral spec
in test_family_parity.py, over pixtral_testing.FIXTURE.
"""

from __future__ import annotations

import torch
from pixtral_testing import SPECS, PixtralCase, load_hf_reference, make_tiny_pixtral_checkpoint
from rope_vlm_testing import VLPrompt

from tessera.models.registry import load_model
from tests.models.family_parity import check_processed_prompt_matches_hf


def test_real_processor_checkpoint_matches_hf(tmp_path):
    """make_tiny_pixtral_checkpoint: AutoProcessor loads a PixtralProcessor; our processor (through the family
    table's pixtral row) gives HF's input_ids and pixels for a wide and a tall image in one prompt, and our
    model's logits and greedy tokens on our processor's output equal HF's on HF's processor output."""
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor
    from transformers import PixtralProcessor as HFPixtralProcessor

    from tessera.multimodal.media import MediaLimits
    from tessera.multimodal.processors.pixtral import PixtralProcessor
    from tests.multimodal.processor_registry import create_processor

    path = make_tiny_pixtral_checkpoint(tmp_path / "ckpt", SPECS["llama_tied_layers"], seed=3)
    hf_processor = AutoProcessor.from_pretrained(path)
    assert isinstance(hf_processor, HFPixtralProcessor)
    hf = load_hf_reference(path)
    ours, config = load_model(path, torch.float32)
    processor = create_processor(hf_processor, config.hf_config, limits=MediaLimits.offline())
    assert isinstance(processor, PixtralProcessor)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (40, 130, 3), dtype=np.uint8)),
              Image.fromarray(rng.integers(0, 256, (90, 50, 3), dtype=np.uint8))]
    content = [{"type": "image"}, {"type": "text", "text": "What is shown here?"}, {"type": "image"}]
    text = hf_processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False)
    try:
        out = processor.process(prompt=text, image_data=images)
    finally:
        processor.close()
    ref = hf_processor(text=[text], images=images, return_tensors="pt")
    assert out.input_ids == ref["input_ids"][0].tolist()
    sizes = ref["image_sizes"].tolist()
    assert [list(it.feature.shape[1:]) for it in out.mm_inputs.items] == sizes
    for it, pixels, (h, w) in zip(out.mm_inputs.items, ref["pixel_values"], sizes):
        torch.testing.assert_close(it.feature, pixels[:, :h, :w], atol=0, rtol=0)
    inputs = {k: ref[k] for k in ("input_ids", "pixel_values", "image_sizes")}
    case = PixtralCase(SPECS["llama_tied_layers"], hf, ours, path)
    check_processed_prompt_matches_hf(case, VLPrompt(torch.tensor(out.input_ids), out.mm_inputs.items), inputs)
