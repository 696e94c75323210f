"""Llama-4 beyond the family parity suite (test_family_parity.py runs prefill, decode across attention-chunk
boundaries, batches, chunked prefill, a prefix hit, the tower and the language model alone for both
llama4_testing.SPECS, and the checks in llama4_testing.FIXTURE: chunked attention, NoPE and temperature tuning
matter): the chunk masks themselves and the text-only Llama4ForCausalLM.
"""

from __future__ import annotations

import torch
from llama4_testing import SPECS
from paged_driver import check_text_prefill_and_decode

from tessera.layers.llama4_decoder import chunk_masks
from tessera.models.registry import load_model


def test_chunk_masks_follow_absolute_positions():
    """A step of queries 6..12 over 13 keys with chunk 4: query p sees keys 4 * (p // 4) .. p."""
    from tessera.layers.forward_batch import ForwardBatch

    fb = ForwardBatch(input_ids=torch.zeros(8, dtype=torch.long), positions=torch.arange(8),
                      out_cache_loc=torch.arange(8), req_pool_indices=torch.tensor([0, 1]),
                      seq_lens=torch.tensor([13, 3]), extend_lens=torch.tensor([7, 1]),
                      req_to_token=torch.zeros(2, 16, dtype=torch.long))
    first, second = chunk_masks(fb, 4)
    assert second is None  # a sequence inside its first chunk stays plainly causal
    expected = torch.tensor([[k <= p and k // 4 == p // 4 for k in range(13)] for p in range(6, 13)])
    assert torch.equal(first, expected)


def test_text_only_llama4_for_causal_lm_matches_hf(tmp_path):
    """Llama4ForCausalLM (`model.*`, `lm_head.*`): the same decoder, with llama3-scaled RoPE; prefill, then
    decode across chunk boundaries."""
    from llama4_testing import tiny_llama4_config
    from transformers import Llama4ForCausalLM as HFLlama4ForCausalLM

    from tessera.models.llama4 import Llama4ForCausalLM

    text_config = tiny_llama4_config(SPECS["gqa_chunked"]).text_config
    text_config.architectures = ["Llama4ForCausalLM"]
    # Llama-4 checkpoints scale RoPE the llama3 way; a short original context makes the scaling bite here.
    text_config.rope_parameters = {"rope_type": "llama3", "rope_theta": 10_000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 16}
    torch.manual_seed(5)
    hf = HFLlama4ForCausalLM._from_config(text_config, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in hf.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.copy_(0.5 + torch.rand(module.weight.shape, generator=g))
        hf.lm_head.weight.normal_(0.0, 0.5, generator=g)
    hf.save_pretrained(tmp_path)
    ours, config = load_model(tmp_path, torch.float32)
    assert isinstance(ours, Llama4ForCausalLM) and config.rope_type == "llama3"
    ids = torch.randint(0, 120, (14,), generator=g)
    check_text_prefill_and_decode(hf, ours, ids, 6)
