"""Parity of our paged Pixtral (LLaVA with a Pixtral tower) with transformers on tiny random checkpoints:
Mistral text (GQA, head_dim != hidden / heads, untied, last vision layer, biased GELU projector) and Llama
text (MHA, tied, two vision layers concatenated, unbiased SiLU projector). Images are pixels at native
resolution, fed directly (the processor is tested against HF in the real-processor test and
tests/multimodal/test_mm_pixtral_processor.py); everything runs over the paged KV test driver.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fixture_checks import check_greedy_depends_on_inputs, prompt_variants
from pixtral_testing import (
    SPECS,
    TinySpec,
    build_prompt,
    build_tiny_pixtral,
    hf_image_inputs,
    load_hf_reference,
    make_tiny_pixtral_checkpoint,
)
from rope_vlm_testing import (
    ATOL,
    MIN_MARGIN,
    VLPrompt,
    hf_generate,
    hf_greedy,
    hf_logits,
    our_greedy,
    our_logits,
    prefix_hit_logits,
    prompt_mm_embeds,
    top2_margin,
)

from tessera.models.pixtral import PixtralLlavaForConditionalGeneration
from tessera.models.registry import load_model

PROMPTS = {  # ("image", (rows, cols)) in patches
    "text": [12],
    "square": [5, ("image", (3, 3)), 4],
    "wide": [3, ("image", (2, 7)), 2],
    "tall": [2, ("image", (6, 2)), 3],
    "one_patch": [4, ("image", (1, 1)), 2],
    "two_sizes": [3, ("image", (4, 3)), 2, ("image", (2, 5)), 3],
}
DECODE_PROMPT = [3, ("image", (3, 4)), 2, ("image", (2, 2)), 4]


@dataclass
class Case:
    spec: TinySpec
    hf: torch.nn.Module
    ours: PixtralLlavaForConditionalGeneration
    path: Path


@pytest.fixture(scope="module", params=list(SPECS))
def case(request, tmp_path_factory) -> Case:
    spec = SPECS[request.param]
    path = tmp_path_factory.mktemp(f"pixtral_{spec.name}")
    hf = build_tiny_pixtral(path, spec)
    ours, config = load_model(path, torch.float32)
    assert isinstance(ours, PixtralLlavaForConditionalGeneration)
    assert config.family.vision_model_type == "pixtral" and config.tie_word_embeddings == spec.tie
    assert config.head_dim == spec.head_dim
    assert config.sliding_windows == (spec.sliding_window,) * spec.layers  # Mistral slides every layer
    # The fixture must be able to fail: text-sized image embeddings; greedy output that depends on the image
    # and the text, is not one repeated token, and is not decided by float noise.
    base = build_prompt(spec, DECODE_PROMPT, seed=0)
    _, embeds = prompt_mm_embeds(ours, base)
    ratio = float(embeds.pow(2).mean().sqrt() / ours.model.embed_tokens.weight.pow(2).mean().sqrt())
    assert 0.5 < ratio < 2, f"image embeddings are {ratio:.2f}x the text embeddings' RMS"
    _, other_image, other_text = prompt_variants(lambda: build_prompt(spec, DECODE_PROMPT, seed=0))
    other_image.hf_extra = hf_image_inputs(other_image.items)
    tokens = check_greedy_depends_on_inputs(lambda p: hf_greedy(hf, p.hf_inputs(), 8), base, other_image, other_text)
    assert hf_greedy(hf, base.hf_inputs(), 8)[0] == tokens == hf_generate(hf, base.hf_inputs(), 8)
    return Case(spec, hf, ours, path)


@pytest.mark.parametrize("prompt_name", list(PROMPTS))
def test_prefill_logits_match_hf(case, prompt_name):
    prompt = build_prompt(case.spec, PROMPTS[prompt_name], seed=1)
    ref = hf_logits(case.hf, prompt)
    torch.testing.assert_close(our_logits(case.ours, prompt), ref, atol=ATOL, rtol=0)
    assert top2_margin(ref[-1]) > MIN_MARGIN


def test_images_of_different_sizes_in_one_tower_call(case, monkeypatch):
    """Images of three sizes from two prompts: one tower call, each image's rows equal HF's features of that
    image encoded alone (the packed sequence's block mask keeps images apart)."""
    a = build_prompt(case.spec, [2, ("image", (5, 3)), 1, ("image", (1, 6)), 1], seed=2)
    b = build_prompt(case.spec, [1, ("image", (2, 2)), 1], seed=3)
    items = a.items + b.items
    calls = []
    tower = case.ours.vision_tower
    monkeypatch.setattr(tower, "forward", lambda *x, _f=tower.forward, **k: calls.append(1) or _f(*x, **k))
    with torch.inference_mode():
        ours = case.ours.get_image_feature(items)
        refs = [case.hf.model.get_image_features(it.feature[None], image_sizes=torch.tensor(
            [list(it.feature.shape[1:])])).pooler_output[0] for it in items]
    assert len(calls) == 1, "all images of a step go through the vision tower in one call"
    assert [o.shape[0] for o in ours] == [15, 6, 4]
    for o, r in zip(ours, refs):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_decode_matches_hf(case, page_size):
    prompt = build_prompt(case.spec, DECODE_PROMPT, seed=3)
    ref, margin = hf_greedy(case.hf, prompt.hf_inputs(), 10)
    assert margin > MIN_MARGIN
    assert our_greedy(case.ours, [prompt], 10, page_size) == [ref]


def test_mixed_batch_matches_hf(case):
    """A text-only request and two requests with images of different sizes, prefilled in one forward (their
    images encoded in one tower call) and then decoded together."""
    prompts = [build_prompt(case.spec, PROMPTS["text"], seed=4),
               build_prompt(case.spec, PROMPTS["two_sizes"], seed=5),
               build_prompt(case.spec, PROMPTS["tall"], seed=6)]
    refs = [hf_greedy(case.hf, p.hf_inputs(), 6) for p in prompts]
    assert min(m for _, m in refs) > MIN_MARGIN
    assert our_greedy(case.ours, prompts, 6, page_size=4) == [t for t, _ in refs]


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_matches_hf(case, page_size):
    """Chunks of 5 tokens: every image (12 and 10 [IMG] tokens with their breaks) spans several chunks, and
    chunk boundaries fall inside rows and on [IMG_BREAK] tokens."""
    prompt = build_prompt(case.spec, [5, ("image", (3, 4)), 1, ("image", (2, 5)), 4], seed=6)
    torch.testing.assert_close(our_logits(case.ours, prompt, page_size, chunk=5), hf_logits(case.hf, prompt),
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefix_cache_hit_matches_hf(case, page_size):
    """B repeats A's image and differs only in its trailing text: B reuses A's KV for a page-aligned prefix that
    ends inside (page_size 4) or just after (page_size 1) the image, and extends the rest."""
    a = build_prompt(case.spec, [4, ("image", (3, 3)), 6], seed=7)
    b = build_prompt(case.spec, [4, ("image", (3, 3)), 6], seed=7)
    b.input_ids[-6:] = torch.tensor([11, 22, 33, 44, 55, 66])
    image_end = 4 + 3 * 4  # one past [IMG_END]
    shared = image_end if page_size == 1 else 8
    torch.testing.assert_close(prefix_hit_logits(case.ours, a, b, shared, page_size),
                               hf_logits(case.hf, b)[shared:], atol=ATOL, rtol=0)


def test_language_model_only_skips_the_tower(case):
    ours, _ = load_model(case.path, torch.float32, language_model_only=True)
    assert ours.vision_tower is None and ours.encoders() == {}
    prompt = build_prompt(case.spec, PROMPTS["text"], seed=8)
    torch.testing.assert_close(our_logits(ours, prompt), hf_logits(case.hf, prompt), atol=ATOL, rtol=0)


def test_same_seed_same_bytes(tmp_path):
    paths = [tmp_path / "one", tmp_path / "two"]
    for p in paths:
        build_tiny_pixtral(p, SPECS["llama_tied_layers"])
    for name in ("model.safetensors", "config.json"):
        assert (paths[0] / name).read_bytes() == (paths[1] / name).read_bytes(), name


def test_real_processor_checkpoint_matches_hf(tmp_path):
    """make_tiny_pixtral_checkpoint: AutoProcessor loads a PixtralProcessor; our processor (through the family
    table's pixtral row) gives HF's input_ids and pixels for a wide and a tall image in one prompt, and our
    model's logits and greedy tokens on our processor's output equal HF's on HF's processor output."""
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor
    from transformers import PixtralProcessor as HFPixtralProcessor

    from tessera.multimodal.media import MediaLimits
    from tessera.multimodal.processors.pixtral import PixtralProcessor
    from tests.multimodal.processor_registry import create_processor

    path = make_tiny_pixtral_checkpoint(tmp_path / "ckpt", SPECS["llama_tied_layers"], seed=3)
    hf_processor = AutoProcessor.from_pretrained(path)
    assert isinstance(hf_processor, HFPixtralProcessor)
    hf = load_hf_reference(path)
    ours, config = load_model(path, torch.float32)
    processor = create_processor(hf_processor, config.hf_config, limits=MediaLimits.offline())
    assert isinstance(processor, PixtralProcessor)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (40, 130, 3), dtype=np.uint8)),
              Image.fromarray(rng.integers(0, 256, (90, 50, 3), dtype=np.uint8))]
    content = [{"type": "image"}, {"type": "text", "text": "What is shown here?"}, {"type": "image"}]
    text = hf_processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False)
    try:
        out = processor.process(prompt=text, image_data=images)
    finally:
        processor.close()
    ref = hf_processor(text=[text], images=images, return_tensors="pt")
    assert out.input_ids == ref["input_ids"][0].tolist()
    sizes = ref["image_sizes"].tolist()
    assert [list(it.feature.shape[1:]) for it in out.mm_inputs.items] == sizes
    for it, pixels, (h, w) in zip(out.mm_inputs.items, ref["pixel_values"], sizes):
        torch.testing.assert_close(it.feature, pixels[:, :h, :w], atol=0, rtol=0)
    inputs = {k: ref[k] for k in ("input_ids", "pixel_values", "image_sizes")}
    ref_tokens, margin = hf_greedy(hf, inputs, 6)
    assert margin > MIN_MARGIN
    prompt = VLPrompt(torch.tensor(out.input_ids), out.mm_inputs.items, {})
    torch.testing.assert_close(our_logits(ours, prompt, page_size=2), hf(**inputs).logits[0], atol=ATOL, rtol=0)
    assert our_greedy(ours, [prompt], 6, page_size=2) == [ref_tokens]
