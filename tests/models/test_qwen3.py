"""Text-only Qwen3ForCausalLM (qk-norm, plain RoPE) against transformers on tiny random configs: GQA with
head_dim set apart from hidden // heads, and MHA tied with attention_bias (q/k/v and o biases)."""

from __future__ import annotations

import pytest
import torch
from paged_driver import check_text_prefill_and_decode

from tessera.models.qwen3 import Qwen3ForCausalLM as OurQwen3
from tessera.models.registry import load_model


@pytest.fixture(scope="module", params=["gqa", "mha_tied_bias"])
def qwen3_case(request, tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tied = request.param == "mha_tied_bias"
    cfg = Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4 if tied else 2, head_dim=24 if tied else 16,
                      attention_bias=tied, rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=tied,
                      max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # HF starts norm weights at 1 and biases at 0: a dropped qk-norm or bias would pass
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    path = tmp_path_factory.mktemp(f"qwen3_{request.param}")
    hf.save_pretrained(path)
    ours, _ = load_model(path, torch.float32)
    assert isinstance(ours, OurQwen3)
    attn = ours.model.layers[0].self_attn
    assert attn.q_norm is not None and (attn.o_proj.bias is not None) == tied
    return hf, ours


def test_prefill_and_greedy_decode_match_hf(qwen3_case):
    hf, ours = qwen3_case
    ids = torch.randint(1, 96, (11,), generator=torch.Generator().manual_seed(1))
    _, ref = check_text_prefill_and_decode(hf, ours, ids, 12)
    assert len(set(ref)) >= 3, f"greedy output {ref} is (nearly) one repeated token"
