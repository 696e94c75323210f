"""InternVL against transformers through a complete checkpoint and the real processor. The model parity tests
(prefill, decode, batches, chunks, prefix hits, the tower, the language model alone) run for every InternVL spec
in test_family_parity.py, over internvl_testing.FIXTURE.
"""

from __future__ import annotations

import torch
from internvl_testing import SPECS, InternVLCase, load_hf_reference, make_tiny_internvl_checkpoint
from rope_vlm_testing import VLPrompt

from tests.models.family_parity import check_processed_prompt_matches_hf, load_real_processor, process_two_images


def test_real_processor_checkpoint_matches_hf(tmp_path):
    """make_tiny_internvl_checkpoint: AutoProcessor loads an InternVLProcessor; our processor (through the
    registry) gives HF's input_ids and tiles for a wide and a tall image, and our model's logits and greedy
    tokens on our processor's output equal HF's on HF's processor output."""
    from transformers import InternVLProcessor as HFInternVLProcessor

    from tessera.multimodal.processors.internvl import InternVLProcessor

    path = make_tiny_internvl_checkpoint(tmp_path / "ckpt", SPECS["qwen3_tied"], max_patches=4, seed=3)
    case, processor, hf_processor = load_real_processor(path, load_hf_reference, InternVLCase, SPECS["qwen3_tied"])
    assert isinstance(hf_processor, HFInternVLProcessor) and isinstance(processor, InternVLProcessor)
    out, ref = process_two_images(processor, hf_processor, ["image", "image", "What is shown here?"])
    assert [it.feature.shape[0] for it in out.mm_inputs.items] == [4, 3]  # 3x1 + thumbnail, 1x2 + thumbnail
    torch.testing.assert_close(torch.cat([it.feature for it in out.mm_inputs.items]), ref["pixel_values"],
                               atol=0, rtol=0)
    inputs = {"input_ids": ref["input_ids"], "pixel_values": ref["pixel_values"]}
    check_processed_prompt_matches_hf(case, VLPrompt(torch.tensor(out.input_ids), out.mm_inputs.items), inputs)
