"""Text-only Qwen2ForCausalLM (plain RoPE) against transformers on a tiny random config."""

from __future__ import annotations

import pytest
import torch
from paged_driver import PagedKV, Step, make_batch

from tessera.models.registry import load_model


@pytest.fixture(scope="module", params=["gqa", "mha_tied"])
def qwen2_case(request, tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tied = request.param == "mha_tied"
    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4 if tied else 2, rms_norm_eps=1e-6,
                      initializer_range=0.1, tie_word_embeddings=tied, max_position_embeddings=256,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    path = tmp_path_factory.mktemp(f"qwen2_{request.param}")
    hf.save_pretrained(path)
    ours, _ = load_model(path, torch.float32)
    return hf, ours


def test_prefill_and_greedy_decode_match_hf(qwen2_case):
    hf, ours = qwen2_case
    ids = torch.randint(0, 96, (11,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref_logits = hf(ids[None]).logits[0]
        ref = hf.generate(ids[None], attention_mask=torch.ones(1, 11, dtype=torch.long), max_new_tokens=12,
                          do_sample=False, pad_token_id=0, eos_token_id=None)[0, 11:].tolist()
        kv = PagedKV(ours.lm_config, page_size=4)
        row = kv.new_request()
        logits = ours(make_batch(kv, [Step(row, ids, torch.arange(11), all_logits=True)]), kv.pool)
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
        tokens = []
        for _ in range(12):
            tokens.append(int(logits[-1].argmax()))
            # Plain-RoPE models take [T] positions.
            logits = ours(make_batch(kv, [Step(row, torch.tensor(tokens[-1:]), torch.tensor([kv.lens[row]]))]), kv.pool)
    assert tokens == ref
