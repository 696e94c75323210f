"""Gemma-3 beyond the family parity suite (test_family_parity.py runs prefill, decode, batches, span-keeping
chunks, prefix hits, the tower and the language model alone for both gemma3_testing.SPECS, and the checks in
gemma3_testing.FIXTURE): the prompt layout, the text-only Gemma3ForCausalLM, and the Triton backend.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from fixture_checks import MIN_MARGIN, top2_margin
from gemma3_testing import BOI_ID, EOI_ID, IMAGE_ID, SPECS, Gemma3Case, build_prompt, build_tiny_gemma3, \
    tiny_gemma3_config
from paged_driver import PagedKV, check_text_prefill_and_decode, decode_greedy, make_batch

from tessera.models.registry import load_model
from tests.models.family_parity import ATOL


def test_prompt_layout():
    """The test prompts look like the processor's: <boi> + image tokens + <eoi> per image and crop."""
    spec = SPECS["gqa"]
    p = build_prompt([1, ("image", 1)], spec.tokens_per_image, spec.image_size)
    (s0, e0), (s1, e1) = p.items[0].offsets
    ids = p.input_ids.tolist()
    assert ids[s0 - 1] == BOI_ID and ids[e0] == EOI_ID and set(ids[s0:e0]) == {IMAGE_ID} and e1 == len(ids) - 1
    assert p.items[0].num_tokens == 2 * spec.tokens_per_image == int(p.token_type_ids.sum())


def test_text_only_gemma3_for_causal_lm_matches_hf(tmp_path):
    """Gemma3ForCausalLM (gemma-3-1b's architecture): the same decoder, and this class soft-caps its logits."""
    from transformers import Gemma3ForCausalLM as HFGemma3ForCausalLM

    from tessera.models.gemma3 import Gemma3ForCausalLM

    text_config = tiny_gemma3_config(SPECS["mha_softcap"]).text_config
    text_config.architectures = ["Gemma3ForCausalLM"]
    assert text_config.final_logit_softcapping == 3.0
    torch.manual_seed(5)
    hf = HFGemma3ForCausalLM._from_config(text_config, attn_implementation="eager").eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in hf.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.copy_(torch.rand(module.weight.shape, generator=g) - 0.5)
        hf.model.embed_tokens.weight.mul_(0.25)
    hf.save_pretrained(tmp_path)
    ours, config = load_model(tmp_path, torch.float32)
    assert isinstance(ours, Gemma3ForCausalLM) and config.final_logit_softcap == 3.0
    ids = torch.randint(0, 240, (14,), generator=g)
    ref, _ = check_text_prefill_and_decode(hf, ours, ids, 6)
    assert 1.5 < float(ref.abs().max()) <= 3.0 and top2_margin(ref[-1]) > MIN_MARGIN  # the cap bends them


IN_TRITON_INTERPRETER = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not IN_TRITON_INTERPRETER, reason="runs in a TRITON_INTERPRET=1 subprocess (next test)")
def test_triton_backend_matches_hf(tmp_path):
    """The bidirectional image spans and sliding windows on the Triton backend: chunked prefill (chunks
    smaller than an image, spans kept whole) and decode equal HF's logits and greedy tokens."""
    spec = SPECS["mha_softcap"]
    hf = build_tiny_gemma3(tmp_path, spec)
    ours, _ = load_model(tmp_path, torch.float32, attention_backend="triton")
    case = Gemma3Case(spec, hf, ours, tmp_path)
    prompt = case.prompt([3, ("image", 1), 2, ("image", 0), 4], seed=10)
    ref_tokens, margin = case.hf_greedy(prompt, 5)
    assert margin > MIN_MARGIN
    kv = PagedKV(ours.lm_config, page_size=4)
    row = kv.new_request()
    with torch.inference_mode():
        out = [ours(make_batch(kv, [case.extend_step(row, prompt, lo, hi, all_logits=True)]), kv.pool)
               for lo, hi in case.chunks(prompt, 5)]
    logits = torch.cat(out)
    torch.testing.assert_close(logits, case.hf_logits(prompt), atol=ATOL, rtol=0)
    assert decode_greedy(ours, kv, [row], logits[-1:], 5) == [ref_tokens]


@pytest.mark.slow  # a second interpreter process: ~10 s of CPU
@pytest.mark.skipif(IN_TRITON_INTERPRETER, reason="the Triton test runs in this process")
def test_triton_backend_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "test_triton_backend_matches_hf"], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-4000:] + out.stderr[-2000:]
