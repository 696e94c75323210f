"""Parity of our paged Llama-4 with transformers on tiny random checkpoints.

Two specs (llama4_testing.SPECS): GQA with an untied head, MoE on every other layer (top-2 of 4 experts), qk L2
norm, chunk size 8 and one NoPE layer; MHA with tied embeddings, top-1 routing on layers 0 and 2 (moe_layers),
no qk norm, chunk size 7 and a NoPE first layer. Every prompt crosses several chunk boundaries, and decoding
crosses more; the small floor_scale makes temperature tuning change the NoPE layers' queries within a prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from fixture_checks import MIN_MARGIN, check_greedy_depends_on_inputs, prompt_variants
from llama4_testing import (
    SPECS,
    Prompt,
    TinySpec,
    build_prompt,
    build_tiny_llama4,
    hf_generate,
    hf_greedy,
    hf_greedy_no_cache,
    hf_logits,
    prompt_mm_embeds,
    top2_margin,
)
from paged_driver import (
    PagedKV,
    Step,
    decode_greedy,
    decode_step,
    make_batch,
    share_prefix,
    check_text_prefill_and_decode,
)

from tessera.layers.llama4_decoder import chunk_masks
from tessera.models.llama4 import Llama4ForConditionalGeneration
from tessera.models.registry import load_model

ATOL = 1e-4
PROMPTS = {
    "text": [19],
    "one_tile": [9, ("image", 1, 1), 8],
    "wide": [3, ("image", 1, 3), 2],
    "tall_grid": [2, ("image", 2, 2), 3],
    "two_images": [3, ("image", 2, 1), 2, ("image", 1, 1), 3],
}
DECODE_PROMPT = [3, ("image", 1, 2), 4]


@dataclass
class Case:
    spec: TinySpec
    hf: torch.nn.Module
    ours: Llama4ForConditionalGeneration
    path: Path
    refs: dict = field(default_factory=dict)
    embeds: dict = field(default_factory=dict)

    def prompt(self, parts: list, seed: int) -> Prompt:
        return build_prompt(parts, self.spec, seed=seed)

    def greedy(self, prompt: Prompt, num_new: int) -> tuple[list[int], float]:
        pixels = prompt.pixels()
        key = (tuple(prompt.input_ids.tolist()), None if pixels is None else float(pixels.sum()), num_new)
        if key not in self.refs:
            self.refs[key] = hf_greedy(self.hf, prompt, num_new)
        return self.refs[key]

    def mm_embeds(self, prompt: Prompt) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """prompt_mm_embeds, remembered per prompt (chunked prefill encodes the images once, as the worker)."""
        pixels = prompt.pixels()
        key = (tuple(prompt.input_ids.tolist()), None if pixels is None else float(pixels.sum()))
        if key not in self.embeds:
            with torch.inference_mode():
                self.embeds[key] = prompt_mm_embeds(self.ours, prompt)
        return self.embeds[key]


@pytest.fixture(scope="module", params=list(SPECS))
def case(request, tmp_path_factory) -> Case:
    spec = SPECS[request.param]
    path = tmp_path_factory.mktemp(f"llama4_{spec.name}")
    hf = build_tiny_llama4(path, spec)
    ours, config = load_model(path, torch.float32)
    assert isinstance(ours, Llama4ForConditionalGeneration)
    settings = ours.model.settings
    assert settings.use_rope == tuple(bool(x) for x in spec.no_rope_layers)
    assert settings.is_moe == tuple(i in hf.config.text_config.moe_layers for i in range(spec.layers))
    assert any(settings.is_moe) and not all(settings.is_moe) and not all(settings.use_rope)
    c = Case(spec, hf, ours, path)
    # The fixture must be able to fail: image embeddings are text-sized, greedy output depends on the image and
    # the text, is not one repeated token, its choices are not float noise.
    base = c.prompt(DECODE_PROMPT, seed=0)
    _, embeds = prompt_mm_embeds(ours, base)
    text = ours.model.embed_tokens(torch.arange(120))
    ratio = float(embeds.pow(2).mean().sqrt() / text.pow(2).mean().sqrt())
    assert 0.5 < ratio < 2, f"image embeddings are {ratio:.2f}x the text embeddings' RMS"
    _, other_image, other_text = prompt_variants(lambda: c.prompt(DECODE_PROMPT, seed=0))
    tokens = check_greedy_depends_on_inputs(lambda p: c.greedy(p, 8), base, other_image, other_text)
    # The stepped reference is HF generate's, and HF's chunked KV cache agrees with recomputing everything.
    assert tokens == hf_generate(hf, base, 8) == hf_greedy_no_cache(hf, base, 8)
    return c


def extend_step(case: Case, row: int, prompt: Prompt, lo: int, hi: int, **kw) -> Step:
    rows, embeds = case.mm_embeds(prompt)
    mm_rows = mm_embeds = None
    if rows is not None:
        sel = (rows >= lo) & (rows < hi)
        if sel.any():
            mm_rows, mm_embeds = rows[sel] - lo, embeds[sel]
    return Step(row, prompt.input_ids[lo:hi], torch.arange(lo, hi), mm_rows, mm_embeds, **kw)


@pytest.mark.parametrize("prompt_name", list(PROMPTS))
def test_prefill_logits_match_hf(case, prompt_name):
    prompt = case.prompt(PROMPTS[prompt_name], seed=1)
    assert len(prompt) > 2 * case.spec.attention_chunk_size
    kv = PagedKV(case.ours.lm_config)
    with torch.inference_mode():
        step = extend_step(case, kv.new_request(), prompt, 0, len(prompt), all_logits=True)
        ours = case.ours(make_batch(kv, [step]), kv.pool)
    ref = hf_logits(case.hf, prompt)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    assert top2_margin(ref[-1]) > MIN_MARGIN


def test_image_features_match_hf_in_one_tower_call(case, monkeypatch):
    prompt = case.prompt([2, ("image", 2, 2), 1, ("image", 1, 1)], seed=2)
    calls = []
    tower = case.ours.vision_model
    monkeypatch.setattr(tower, "forward", lambda *a, _f=tower.forward, **k: calls.append(1) or _f(*a, **k))
    with torch.inference_mode():
        ours = case.ours.get_image_feature(prompt.items)
        hf = case.hf
        ref = hf.multi_modal_projector(hf.vision_model(prompt.pixels()).last_hidden_state)
    assert len(calls) == 1, "all tiles of a step go through the vision tower in one call"
    n = case.spec.tokens_per_tile
    assert [o.shape[0] for o in ours] == [5 * n, n]
    torch.testing.assert_close(torch.cat(ours), ref.reshape(-1, ref.shape[-1]), atol=1e-5, rtol=0)


def test_greedy_decode_across_chunk_boundaries_matches_hf(case, page_size=4):
    prompt = case.prompt(DECODE_PROMPT, seed=0)
    num_new = 8
    chunk = case.spec.attention_chunk_size
    # The decode steps feed positions len .. len + num_new - 2: one of them must start a new chunk.
    assert any(p % chunk == 0 for p in range(len(prompt), len(prompt) + num_new - 1)), "no chunk boundary crossed"
    ref_tokens, _ = case.greedy(prompt, num_new)
    model, kv = case.ours, PagedKV(case.ours.lm_config, page_size=page_size)
    row = kv.new_request()
    with torch.inference_mode():
        logits = model(make_batch(kv, [extend_step(case, row, prompt, 0, len(prompt))]), kv.pool)[-1:]
    assert decode_greedy(model, kv, [row], logits, num_new) == [ref_tokens]


def test_two_requests_in_one_batch_match_hf(case):
    """A prompt with two images and a short text-only one (inside the first chunk: no mask), prefilled in one
    forward, then decoded together until the short one crosses its first chunk boundary too."""
    chunk = case.spec.attention_chunk_size
    prompts = [case.prompt(PROMPTS["two_images"], seed=11), case.prompt([chunk - 3], seed=5)]
    num_new = 6
    refs = [case.greedy(p, num_new) for p in prompts]
    assert min(m for _, m in refs) > MIN_MARGIN
    model, kv = case.ours, PagedKV(case.ours.lm_config, page_size=4)
    rows = [kv.new_request(), kv.new_request()]
    with torch.inference_mode():
        logits = model(make_batch(kv, [extend_step(case, r, p, 0, len(p)) for r, p in zip(rows, prompts)]),
                       kv.pool)
        for p, lo in zip(prompts, logits):
            torch.testing.assert_close(lo, hf_logits(case.hf, p)[-1], atol=ATOL, rtol=0)
    assert decode_greedy(model, kv, rows, logits, num_new) == [t for t, _ in refs]


@pytest.mark.parametrize("page_size,step", [(1, 3), (4, 5)])
def test_chunked_prefill_matches_hf(case, page_size, step):
    """Prefill chunks smaller than one image (a tile's patch run is split), unaligned with the attention chunks."""
    prompt = case.prompt([4, ("image", 2, 1), 3, ("image", 1, 1), 4], seed=6)
    assert step < case.spec.tokens_per_tile * 3
    model, kv = case.ours, PagedKV(case.ours.lm_config, page_size=page_size)
    row = kv.new_request()
    with torch.inference_mode():
        out = [model(make_batch(kv, [extend_step(case, row, prompt, lo, min(lo + step, len(prompt)),
                                                 all_logits=True)]), kv.pool)
               for lo in range(0, len(prompt), step)]
    torch.testing.assert_close(torch.cat(out), hf_logits(case.hf, prompt), atol=ATOL, rtol=0)


def test_prefix_cache_hit_matches_hf(case, page_size=4):
    """B repeats A's image and differs after it; B reuses A's KV up to its last page before the difference (the
    image included). Both then decode in one batch."""
    spec = [3, ("image", 1, 2), 8]
    a = case.prompt(spec, seed=8)
    b = case.prompt(spec, seed=8)
    b.input_ids[-6:] = torch.tensor([11, 22, 33, 44, 55, 66])
    shared = (len(a) - 6) // page_size * page_size
    assert shared >= a.items[0].offsets[-1][1]
    num_new = 4
    refs = [case.greedy(p, num_new) for p in (a, b)]
    model, kv = case.ours, PagedKV(case.ours.lm_config, page_size=page_size)
    ra, rb = kv.new_request(), kv.new_request()
    with torch.inference_mode():
        la = model(make_batch(kv, [extend_step(case, ra, a, 0, len(a))]), kv.pool)[-1]
        share_prefix(kv, ra, rb, shared)
        lb_all = model(make_batch(kv, [extend_step(case, rb, b, shared, len(b), all_logits=True)]), kv.pool)
        torch.testing.assert_close(lb_all, hf_logits(case.hf, b)[shared:], atol=ATOL, rtol=0)
    assert decode_greedy(model, kv, [ra, rb], [la, lb_all[-1]], num_new) == [t for t, _ in refs]


def test_chunked_attention_and_nope_matter(case, monkeypatch):
    """The fixture exercises what it claims: without the chunk masks, or with RoPE on the NoPE layers, or without
    temperature tuning, the logits move well past the tolerance."""
    import tessera.layers.llama4_decoder as dec

    prompt = case.prompt(PROMPTS["one_tile"], seed=1)
    ref = hf_logits(case.hf, prompt)

    def run() -> torch.Tensor:
        kv = PagedKV(case.ours.lm_config)
        with torch.inference_mode():
            step = extend_step(case, kv.new_request(), prompt, 0, len(prompt), all_logits=True)
            return case.ours(make_batch(kv, [step]), kv.pool)

    monkeypatch.setattr(dec, "chunk_masks", lambda fb, chunk: None)
    assert (run() - ref).abs().max() > 100 * ATOL, "chunked attention makes no difference"
    monkeypatch.undo()
    nope = [layer.self_attn for layer in case.ours.model.layers if not layer.self_attn.use_rope]
    saved = [a.temperature for a in nope]
    try:
        for a in nope:
            a.temperature = None
        assert (run() - ref).abs().max() > 100 * ATOL, "temperature tuning makes no difference"
        for a, t in zip(nope, saved):
            a.temperature, a.use_rope = t, True
        assert (run() - ref).abs().max() > 100 * ATOL, "NoPE makes no difference"
    finally:
        for a, t in zip(nope, saved):
            a.temperature, a.use_rope = t, False
    torch.testing.assert_close(run(), ref, atol=ATOL, rtol=0)


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


def test_language_model_only_loads_without_the_tower(case):
    ours, _ = load_model(case.path, torch.float32, language_model_only=True)
    assert ours.vision_model is None and ours.encoders() == {}
    prompt = case.prompt([21], seed=9)
    kv = PagedKV(ours.lm_config)
    with torch.inference_mode():
        logits = ours(make_batch(kv, [extend_step(case, kv.new_request(), prompt, 0, len(prompt))]), kv.pool)
    torch.testing.assert_close(logits[-1], hf_logits(case.hf, prompt)[-1], atol=ATOL, rtol=0)


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
