"""Text-only Qwen2ForCausalLM (plain RoPE) against transformers on a tiny random config."""

from __future__ import annotations

import pytest
import torch
from paged_driver import PagedKV, Step, check_text_prefill_and_decode, make_batch

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
    check_text_prefill_and_decode(hf, ours, ids, 12)


@pytest.fixture(scope="module")
def sliding_case(tmp_path_factory):
    """Qwen2 whose second and third layers attend over a 5-token window (use_sliding_window)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, initializer_range=0.1,
                      max_position_embeddings=256, use_sliding_window=True, sliding_window=5, max_window_layers=1,
                      rope_parameters={"rope_type": "default", "rope_theta": 1000.0})
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    torch.manual_seed(3)
    hf = Qwen2ForCausalLM._from_config(cfg, attn_implementation="eager").eval()
    path = tmp_path_factory.mktemp("qwen2_sliding")
    hf.save_pretrained(path)
    hf.name_or_path = str(path)
    ours, config = load_model(path, torch.float32)
    assert config.sliding_windows == (None, 5, 5)
    return hf, ours


@pytest.mark.parametrize("mirror", [False, True])
def test_sliding_window_layers_match_hf(sliding_case, mirror):
    """Two prompts (13 and 6 tokens, longer and shorter than the window) prefilled in chunks, then decoded
    together past the window: the extend, gathered-decode and mirrored-decode paths all apply it."""
    hf, ours = sliding_case
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 96, (n,), generator=gen) for n in (13, 6)]
    num_new = 10
    refs = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf.generate(ids[None], attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=num_new, do_sample=False, pad_token_id=0, eos_token_id=None)
            refs.append(out[0, len(ids):].tolist())
        full = hf(prompts[0][None]).logits[0]
        # The window matters on these inputs: the same weights attending everywhere give other logits.
        unwindowed = type(hf).from_pretrained(hf.name_or_path, use_sliding_window=False,
                                              layer_types=["full_attention"] * 3).eval()
        assert (unwindowed(prompts[0][None]).logits[0] - full).abs().max() > 1e-2
        assert refs[0] != refs[1]
        kv = PagedKV(ours.lm_config, page_size=4)
        rows = [kv.new_request(), kv.new_request()]
        # Prefill: the first prompt in two chunks (7 + 6, the second chunk sees a cached prefix).
        first = ours(make_batch(kv, [Step(rows[0], prompts[0][:7], torch.arange(7), all_logits=True)]), kv.pool)
        logits = ours(make_batch(kv, [Step(rows[0], prompts[0][7:], torch.arange(7, 13), all_logits=True),
                                      Step(rows[1], prompts[1], torch.arange(6))]), kv.pool)
        torch.testing.assert_close(torch.cat([first, logits[:6]]), full, atol=1e-4, rtol=0)
        last = [logits[5], logits[6]]
        tokens: list[list[int]] = [[], []]
        for _ in range(num_new):
            steps = []
            for i, row in enumerate(rows):
                tokens[i].append(int(last[i].argmax()))
                steps.append(Step(row, torch.tensor(tokens[i][-1:]), torch.tensor([kv.lens[row]])))
            fb = make_batch(kv, steps)
            if mirror:
                fb.req_generations = [kv.req_pool.generation[r] for r in rows]
            last = list(ours(fb, kv.pool))
    assert tokens == refs
