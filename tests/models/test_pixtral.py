"""Pixtral against transformers through a complete checkpoint and the real processor. The model parity tests
(prefill, decode, batches, chunks, prefix hits, the tower, the language model alone) run for every Pixtral spec
in test_family_parity.py, over pixtral_testing.FIXTURE.
"""

from __future__ import annotations

import torch
from pixtral_testing import SPECS, PixtralCase, load_hf_reference, make_tiny_pixtral_checkpoint
from rope_vlm_testing import VLPrompt

from tests.models.family_parity import check_processed_prompt_matches_hf, load_real_processor, process_two_images


def test_real_processor_checkpoint_matches_hf(tmp_path):
    """make_tiny_pixtral_checkpoint: AutoProcessor loads a PixtralProcessor; our processor (through the family
    table's pixtral row) gives HF's input_ids and pixels for a wide and a tall image in one prompt, and our
    model's logits and greedy tokens on our processor's output equal HF's on HF's processor output."""
    from transformers import PixtralProcessor as HFPixtralProcessor

    from tessera.multimodal.processors.pixtral import PixtralProcessor

    path = make_tiny_pixtral_checkpoint(tmp_path / "ckpt", SPECS["llama_tied_layers"], seed=3)
    case, processor, hf_processor = load_real_processor(path, load_hf_reference, PixtralCase,
                                                        SPECS["llama_tied_layers"])
    assert isinstance(hf_processor, HFPixtralProcessor) and isinstance(processor, PixtralProcessor)
    out, ref = process_two_images(processor, hf_processor, ["image", "What is shown here?", "image"],
                                  add_generation_prompt=False)
    sizes = ref["image_sizes"].tolist()
    assert [list(it.feature.shape[1:]) for it in out.mm_inputs.items] == sizes
    for it, pixels, (h, w) in zip(out.mm_inputs.items, ref["pixel_values"], sizes):
        torch.testing.assert_close(it.feature, pixels[:, :h, :w], atol=0, rtol=0)
    inputs = {k: ref[k] for k in ("input_ids", "pixel_values", "image_sizes")}
    check_processed_prompt_matches_hf(case, VLPrompt(torch.tensor(out.input_ids), out.mm_inputs.items), inputs)
