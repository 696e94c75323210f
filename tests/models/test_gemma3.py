"""Parity of our paged Gemma-3 with transformers on tiny random checkpoints.

Two specs (gemma3_testing.SPECS): GQA with tied embeddings and 16 tokens per image; MHA with an untied head,
soft-capping in the config (which transformers' Gemma3ForConditionalGeneration ignores, and so must we), a
linearly scaled global RoPE and 9 tokens per image. Both mix sliding and full layers with windows shorter than
an image, so the window cuts into the bidirectional image spans. Masks come from worker/masks.span_mask over
the items' offsets, as the worker builds them; chunks never split a span, as the scheduler cuts them.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from fixture_checks import MIN_MARGIN, check_greedy_depends_on_inputs, prompt_variants
from gemma3_testing import (
    BOI_ID,
    EOI_ID,
    IMAGE_ID,
    SPECS,
    Prompt,
    TinySpec,
    build_prompt,
    build_tiny_gemma3,
    hf_generate,
    hf_greedy,
    hf_logits,
    prompt_mm_embeds,
    tiny_gemma3_config,
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

from tessera.models.gemma3 import Gemma3ForConditionalGeneration
from tessera.models.registry import load_model
from tessera.worker.masks import span_mask

ATOL = 1e-4
PROMPTS = {
    "text": [12],
    "one_image": [5, ("image", 0), 4],
    "image_with_crops": [3, ("image", 2), 2],  # pan-and-scan: the original and two crops, three spans
    "two_images": [3, ("image", 1), 2, ("image", 0), 3],
}
DECODE_PROMPT = [3, ("image", 1), 4]


@dataclass
class Case:
    spec: TinySpec
    hf: torch.nn.Module
    ours: Gemma3ForConditionalGeneration
    path: Path

    refs: dict = field(default_factory=dict)

    def prompt(self, parts: list, seed: int) -> Prompt:
        return build_prompt(parts, self.spec.tokens_per_image, self.spec.image_size, seed=seed)

    def greedy(self, prompt: Prompt, num_new: int) -> tuple[list[int], float]:
        """hf_greedy, remembered per prompt (tests of several page sizes share their references)."""
        pixels = prompt.pixels()
        key = (tuple(prompt.input_ids.tolist()), None if pixels is None else float(pixels.sum()), num_new)
        if key not in self.refs:
            self.refs[key] = hf_greedy(self.hf, prompt.hf_inputs(), num_new)
        return self.refs[key]


@pytest.fixture(scope="module", params=list(SPECS))
def case(request, tmp_path_factory) -> Case:
    spec = SPECS[request.param]
    path = tmp_path_factory.mktemp(f"gemma3_{spec.name}")
    hf = build_tiny_gemma3(path, spec)
    ours, config = load_model(path, torch.float32)
    assert isinstance(ours, Gemma3ForConditionalGeneration)
    assert config.family.bidirectional_mm_spans and config.hidden_act == "gelu_pytorch_tanh"
    assert config.sliding_windows == tuple(spec.sliding_window if t == "sliding_attention" else None
                                           for t in spec.layer_types)
    c = Case(spec, hf, ours, path)
    # The fixture must be able to fail: image embeddings are text-sized, greedy output depends on the image
    # and on the text, is not one repeated token, its choices are not float noise, and the bidirectional
    # image attention changes the logits.
    base = c.prompt(DECODE_PROMPT, seed=0)
    _, embeds = prompt_mm_embeds(ours, base)
    text = ours.model.embed_tokens(base.input_ids[:3])
    ratio = float(embeds.pow(2).mean().sqrt() / text.pow(2).mean().sqrt())
    assert 0.5 < ratio < 2, f"image embeddings are {ratio:.2f}x the text embeddings' RMS"
    _, other_image, other_text = prompt_variants(lambda: c.prompt(DECODE_PROMPT, seed=0))
    tokens = check_greedy_depends_on_inputs(lambda p: c.greedy(p, 8), base, other_image, other_text)
    causal = {k: v for k, v in base.hf_inputs().items() if k != "token_type_ids"}
    with torch.inference_mode():
        assert (hf(**causal).logits[0] - hf_logits(hf, base)).abs().max() > 100 * ATOL, \
            "bidirectional image attention makes no difference"
    assert tokens == hf_generate(hf, base.hf_inputs(), 8), "the stepped reference is HF generate's"
    return c


def spans_of(prompt: Prompt) -> list[tuple[int, int]]:
    return sorted(r for item in prompt.items for r in item.offsets)


def extend_step(case: Case, row: int, prompt: Prompt, lo: int, hi: int, **kw) -> Step:
    """Tokens lo..hi-1 of `prompt` for request `row` (whose KV holds 0..lo-1): their embedding rows and the
    causal + bidirectional-span mask the worker would build."""
    rows, embeds = prompt_mm_embeds(case.ours, prompt)
    mm_rows = mm_embeds = None
    if rows is not None:
        sel = (rows >= lo) & (rows < hi)
        if sel.any():
            mm_rows, mm_embeds = rows[sel] - lo, embeds[sel]
    mask = span_mask(spans_of(prompt), lo, hi)
    return Step(row, prompt.input_ids[lo:hi], torch.arange(lo, hi), mm_rows, mm_embeds, custom_mask=mask, **kw)


def atomic_chunks(n: int, chunk: int, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[lo, hi) chunks of at most `chunk` tokens, except that a span is never split: a chunk stops before a
    span it would cut, and a chunk starting at a span takes it whole (scheduler/policy._schedule_chunk)."""
    out, lo = [], 0
    while lo < n:
        hi = min(lo + chunk, n)
        for s, e in spans:
            if s < hi < e:
                hi = s if s > lo else e
                break
        out.append((lo, hi))
        lo = hi
    return out


@pytest.mark.parametrize("prompt_name", list(PROMPTS))
def test_prefill_logits_match_hf(case, prompt_name):
    prompt = case.prompt(PROMPTS[prompt_name], seed=1)
    kv = PagedKV(case.ours.lm_config)
    with torch.inference_mode():
        step = extend_step(case, kv.new_request(), prompt, 0, len(prompt), all_logits=True)
        ours = case.ours(make_batch(kv, [step]), kv.pool)
    ref = hf_logits(case.hf, prompt)
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    assert top2_margin(ref[-1]) > MIN_MARGIN


def test_image_features_match_hf_in_one_tower_call(case, monkeypatch):
    prompt = case.prompt([2, ("image", 2), 1, ("image", 0)], seed=2)
    calls = []
    tower = case.ours.vision_tower
    monkeypatch.setattr(tower, "forward", lambda *a, _f=tower.forward, **k: calls.append(1) or _f(*a, **k))
    with torch.inference_mode():
        ours = case.ours.get_image_feature(prompt.items)
        ref = case.hf.model.get_image_features(prompt.pixels()).pooler_output
    assert len(calls) == 1, "all images and crops of a step go through the vision tower in one call"
    per_image = case.spec.tokens_per_image
    assert [o.shape[0] for o in ours] == [3 * per_image, per_image]
    torch.testing.assert_close(torch.cat(ours), ref.reshape(-1, ref.shape[-1]), atol=1e-5, rtol=0)


def test_greedy_decode_matches_hf(case, page_size=4):
    prompt = case.prompt(DECODE_PROMPT, seed=0)  # the fixture's prompt: its reference is remembered
    num_new = 8
    ref_tokens, margin = case.greedy(prompt, num_new)
    assert margin > MIN_MARGIN
    model, kv = case.ours, PagedKV(case.ours.lm_config, page_size=page_size)
    row = kv.new_request()
    with torch.inference_mode():
        logits = model(make_batch(kv, [extend_step(case, row, prompt, 0, len(prompt))]), kv.pool)[-1:]
    assert decode_greedy(model, kv, [row], logits, num_new) == [ref_tokens]


def test_two_requests_in_one_batch_match_hf(case):
    """A prompt with two images and a text-only one, prefilled in one forward, then decoded together."""
    prompts = [case.prompt(PROMPTS["two_images"], seed=4), case.prompt([9], seed=5)]
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


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_matches_hf(case, page_size):
    """Chunks of 5 tokens, fewer than an image's: a chunk that would cut an image span stops before it, and
    the next takes the span whole, so every image query sees all of its image (as the scheduler cuts)."""
    prompt = case.prompt([4, ("image", 1), 3, ("image", 0), 4], seed=6)
    chunks = atomic_chunks(len(prompt), 5, spans_of(prompt))
    assert len(chunks) > 4 and any(hi - lo > 5 for lo, hi in chunks)
    model, kv = case.ours, PagedKV(case.ours.lm_config, page_size=page_size)
    row = kv.new_request()
    with torch.inference_mode():
        out = [model(make_batch(kv, [extend_step(case, row, prompt, lo, hi, all_logits=True)]), kv.pool)
               for lo, hi in chunks]
    torch.testing.assert_close(torch.cat(out), hf_logits(case.hf, prompt), atol=ATOL, rtol=0)


def test_split_image_span_would_differ(case):
    """The reason chunks keep spans whole: an image cut in two, with causal attention across the cut, gives
    other logits than HF's (span_mask refuses such a step)."""
    prompt = case.prompt([2, ("image", 0), 3], seed=7)
    (s, e), = spans_of(prompt)
    cut = s + (e - s) // 2
    with pytest.raises(ValueError, match="split"):
        span_mask(spans_of(prompt), 0, cut)
    model, kv = case.ours, PagedKV(case.ours.lm_config)
    row = kv.new_request()
    rows, embeds = prompt_mm_embeds(model, prompt)
    outs = []
    with torch.inference_mode():
        for lo, hi in ((0, cut), (cut, len(prompt))):
            sel = (rows >= lo) & (rows < hi)
            mask = torch.arange(hi)[None, :] <= torch.arange(lo, hi)[:, None]  # causal only
            step = Step(row, prompt.input_ids[lo:hi], torch.arange(lo, hi), rows[sel] - lo, embeds[sel],
                        custom_mask=mask, all_logits=True)
            outs.append(model(make_batch(kv, [step]), kv.pool))
    assert (torch.cat(outs) - hf_logits(case.hf, prompt)).abs().max() > 100 * ATOL


@pytest.mark.parametrize("page_size,cut", [(1, "after_image"), (4, "after_image"), (1, "at_image")])
def test_prefix_cache_hit_matches_hf(case, page_size, cut):
    """B repeats A's image and differs after it. B reuses A's KV up to its last page before the difference
    (the image included), or, where a cached prefix would end inside the image, only up to the image's start
    (scheduler/policy.KVManager.admit): then B computes the whole image itself. Both then decode in one batch."""
    spec = [3, ("image", 0), 8]
    a = case.prompt(spec, seed=8)
    b = case.prompt(spec, seed=8)
    b.input_ids[-6:] = torch.tensor([11, 22, 33, 44, 55, 66])
    (s, e), = spans_of(a)
    shared = (len(a) - 6) // page_size * page_size if cut == "after_image" else s
    assert shared >= e or shared == s
    num_new = 4
    refs = [case.greedy(p, num_new) for p in (a, b)]
    assert min(m for _, m in refs) > MIN_MARGIN
    model, kv = case.ours, PagedKV(case.ours.lm_config, page_size=page_size)
    ra, rb = kv.new_request(), kv.new_request()
    with torch.inference_mode():
        la = model(make_batch(kv, [extend_step(case, ra, a, 0, len(a))]), kv.pool)[-1]
        share_prefix(kv, ra, rb, shared)
        lb_all = model(make_batch(kv, [extend_step(case, rb, b, shared, len(b), all_logits=True)]), kv.pool)
        torch.testing.assert_close(lb_all, hf_logits(case.hf, b)[shared:], atol=ATOL, rtol=0)
    assert decode_greedy(model, kv, [ra, rb], [la, lb_all[-1]], num_new) == [t for t, _ in refs]


def test_prompt_layout():
    """The test prompts look like the processor's: <boi> + image tokens + <eoi> per image and crop."""
    spec = SPECS["gqa"]
    p = build_prompt([1, ("image", 1)], spec.tokens_per_image, spec.image_size)
    (s0, e0), (s1, e1) = p.items[0].offsets
    ids = p.input_ids.tolist()
    assert ids[s0 - 1] == BOI_ID and ids[e0] == EOI_ID and set(ids[s0:e0]) == {IMAGE_ID} and e1 == len(ids) - 1
    assert p.items[0].num_tokens == 2 * spec.tokens_per_image == int(p.token_type_ids.sum())


def test_same_seed_same_bytes(tmp_path):
    paths = [tmp_path / "one", tmp_path / "two"]
    for p in paths:
        build_tiny_gemma3(p, SPECS["mha_softcap"])
    for name in ("model.safetensors", "config.json"):
        assert (paths[0] / name).read_bytes() == (paths[1] / name).read_bytes(), name


def test_language_model_only_loads_without_the_tower(case):
    ours, _ = load_model(case.path, torch.float32, language_model_only=True)
    assert ours.vision_tower is None and ours.encoders() == {}
    prompt = case.prompt([10], seed=9)
    kv = PagedKV(ours.lm_config)
    with torch.inference_mode():
        logits = ours(make_batch(kv, [extend_step(case, kv.new_request(), prompt, 0, len(prompt))]), kv.pool)
    torch.testing.assert_close(logits[-1], hf_logits(case.hf, prompt)[-1], atol=ATOL, rtol=0)


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
    c = Case(spec, hf, ours, tmp_path)
    prompt = c.prompt([3, ("image", 1), 2, ("image", 0), 4], seed=10)
    ref_tokens, margin = c.greedy(prompt, 5)
    assert margin > MIN_MARGIN
    kv = PagedKV(ours.lm_config, page_size=4)
    row = kv.new_request()
    with torch.inference_mode():
        out = [ours(make_batch(kv, [extend_step(c, row, prompt, lo, hi, all_logits=True)]), kv.pool)
               for lo, hi in atomic_chunks(len(prompt), 5, spans_of(prompt))]
        logits = torch.cat(out)
        torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=ATOL, rtol=0)
        tokens, last = [], logits[-1]
        for _ in range(5):
            tokens.append(int(last.argmax()))
            last = ours(make_batch(kv, [decode_step(kv, row, last)]), kv.pool)[-1]
    assert tokens == ref_tokens


@pytest.mark.slow  # a second interpreter process: ~10 s of CPU
@pytest.mark.skipif(IN_TRITON_INTERPRETER, reason="the Triton test runs in this process")
def test_triton_backend_under_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                          "test_triton_backend_matches_hf"], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-4000:] + out.stderr[-2000:]
