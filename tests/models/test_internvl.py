"""InternVL against transformers through a complete checkpoint and the real processor. The model parity tests
(prefill, decode, batches, chunks, prefix hits, the tower, the language model alone) run for every InternVL spec
in test_family_parity.py, over internvl_testing.FIXTURE.
"""

from __future__ import annotations

import torch
from internvl_testing import SPECS, InternVLCase, load_hf_reference, make_tiny_internvl_checkpoint
from rope_vlm_testing import VLPrompt

from tessera.models.registry import load_model
from tests.models.family_parity import check_processed_prompt_matches_hf


def test_real_processor_checkpoint_matches_hf(tmp_path):
    """make_tiny_internvl_checkpoint: AutoProcessor loads an InternVLProcessor; our processor (through the
    registry) gives HF's input_ids and tiles for a wide and a tall image, and our model's logits and greedy
    tokens on our processor's output equal HF's on HF's processor output."""
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor
    from transformers import InternVLProcessor as HFInternVLProcessor

    from tessera.multimodal.media import MediaLimits
    from tessera.multimodal.processors.internvl import InternVLProcessor
    from tests.multimodal.processor_registry import create_processor

    path = make_tiny_internvl_checkpoint(tmp_path / "ckpt", SPECS["qwen3_tied"], max_patches=4, seed=3)
    hf_processor = AutoProcessor.from_pretrained(path)
    assert isinstance(hf_processor, HFInternVLProcessor)
    hf = load_hf_reference(path)
    ours, config = load_model(path, torch.float32)
    processor = create_processor(hf_processor, config.hf_config, limits=MediaLimits.offline())
    assert isinstance(processor, InternVLProcessor)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (40, 130, 3), dtype=np.uint8)),
              Image.fromarray(rng.integers(0, 256, (90, 50, 3), dtype=np.uint8))]
    content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "What is shown here?"}]
    text = hf_processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=False)
    try:
        out = processor.process(prompt=text, image_data=images)
    finally:
        processor.close()
    ref = hf_processor(text=[text], images=images, return_tensors="pt")
    assert out.input_ids == ref["input_ids"][0].tolist()
    assert [it.feature.shape[0] for it in out.mm_inputs.items] == [4, 3]  # 3x1 + thumbnail, 1x2 + thumbnail
    torch.testing.assert_close(torch.cat([it.feature for it in out.mm_inputs.items]), ref["pixel_values"],
                               atol=0, rtol=0)
    inputs = {"input_ids": ref["input_ids"], "pixel_values": ref["pixel_values"]}
    case = InternVLCase(SPECS["qwen3_tied"], hf, ours, path)
    check_processed_prompt_matches_hf(case, VLPrompt(torch.tensor(out.input_ids), out.mm_inputs.items), inputs)
