"""Parity of our paged InternVL with transformers on tiny random checkpoints: Qwen2 (GQA, untied, last vision
layer), Qwen3 (qk-norm, tied, a middle vision layer, RMSNorm/qk-norm ViT) and Llama (attention bias) text
models. Images are tiles fed directly (the processor's tiling is tested against HF in the real-processor test
and tests/multimodal/test_mm_internvl_processor.py); everything runs over the paged KV test driver.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from fixture_checks import check_greedy_depends_on_inputs, prompt_variants
from internvl_testing import (
    SPECS,
    TinySpec,
    build_prompt,
    build_tiny_internvl,
    load_hf_reference,
    make_tiny_internvl_checkpoint,
)
from rope_vlm_testing import (
    ATOL,
    MIN_MARGIN,
    hf_generate,
    hf_greedy,
    hf_logits,
    our_greedy,
    our_logits,
    prefix_hit_logits,
    prompt_mm_embeds,
    top2_margin,
)

from tessera.models.internvl import InternVLForConditionalGeneration
from tessera.models.registry import load_model

PROMPTS = {
    "text": [12],
    "one_tile": [5, ("image", 1), 4],
    "tiles_and_thumbnail": [3, ("image", 5), 2],  # a 2x2 grid + thumbnail
    "two_images": [3, ("image", 3), 2, ("image", 1), 3],
}
DECODE_PROMPT = [3, ("image", 3), 2, ("image", 1), 4]


@dataclass
class Case:
    spec: TinySpec
    hf: torch.nn.Module
    ours: InternVLForConditionalGeneration
    path: Path


@pytest.fixture(scope="module", params=list(SPECS))
def case(request, tmp_path_factory) -> Case:
    spec = SPECS[request.param]
    path = tmp_path_factory.mktemp(f"internvl_{spec.name}")
    hf = build_tiny_internvl(path, spec)
    ours, config = load_model(path, torch.float32)
    assert isinstance(ours, InternVLForConditionalGeneration)
    assert config.tie_word_embeddings == spec.tie
    # The fixture must be able to fail: text-sized image embeddings; greedy output that depends on the image
    # and the text, is not one repeated token, and is not decided by float noise.
    base = build_prompt(spec, DECODE_PROMPT, seed=0)
    _, embeds = prompt_mm_embeds(ours, base)
    ratio = float(embeds.pow(2).mean().sqrt() / ours.model.embed_tokens.weight.pow(2).mean().sqrt())
    assert 0.5 < ratio < 2, f"image embeddings are {ratio:.2f}x the text embeddings' RMS"
    _, other_image, other_text = prompt_variants(lambda: build_prompt(spec, DECODE_PROMPT, seed=0))
    other_image.hf_extra["pixel_values"] = torch.cat([it.feature for it in other_image.items])
    tokens = check_greedy_depends_on_inputs(lambda p: hf_greedy(hf, p.hf_inputs(), 8), base, other_image, other_text)
    assert hf_greedy(hf, base.hf_inputs(), 8)[0] == tokens == hf_generate(hf, base.hf_inputs(), 8)
    return Case(spec, hf, ours, path)


@pytest.mark.parametrize("prompt_name", list(PROMPTS))
def test_prefill_logits_match_hf(case, prompt_name):
    prompt = build_prompt(case.spec, PROMPTS[prompt_name], seed=1)
    ref = hf_logits(case.hf, prompt)
    torch.testing.assert_close(our_logits(case.ours, prompt), ref, atol=ATOL, rtol=0)
    assert top2_margin(ref[-1]) > MIN_MARGIN


def test_image_features_match_hf_in_one_tower_call(case, monkeypatch):
    prompt = build_prompt(case.spec, [2, ("image", 5), 1, ("image", 2), 1], seed=2)
    calls = []
    tower = case.ours.vision_tower
    monkeypatch.setattr(tower, "forward", lambda *a, _f=tower.forward, **k: calls.append(1) or _f(*a, **k))
    with torch.inference_mode():
        ours = case.ours.get_image_feature(prompt.items)
        ref = case.hf.model.get_image_features(prompt.hf_extra["pixel_values"]).pooler_output
    assert len(calls) == 1, "all tiles of all images of a step go through the vision tower in one call"
    tokens = case.spec.tokens_per_tile
    assert [o.shape[0] for o in ours] == [5 * tokens, 2 * tokens]
    torch.testing.assert_close(torch.cat(ours), ref.reshape(-1, ref.shape[-1]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_decode_matches_hf(case, page_size):
    prompt = build_prompt(case.spec, DECODE_PROMPT, seed=3)
    ref, margin = hf_greedy(case.hf, prompt.hf_inputs(), 10)
    assert margin > MIN_MARGIN
    assert our_greedy(case.ours, [prompt], 10, page_size) == [ref]


def test_mixed_batch_matches_hf(case):
    """A text-only, a one-image and a two-image request of different lengths, prefilled in one forward and then
    decoded together."""
    prompts = [build_prompt(case.spec, PROMPTS["text"], seed=4),
               build_prompt(case.spec, PROMPTS["two_images"], seed=5),
               build_prompt(case.spec, PROMPTS["one_tile"], seed=6)]
    refs = [hf_greedy(case.hf, p.hf_inputs(), 6) for p in prompts]
    assert min(m for _, m in refs) > MIN_MARGIN
    assert our_greedy(case.ours, prompts, 6, page_size=4) == [t for t, _ in refs]


@pytest.mark.parametrize("page_size", [1, 4])
def test_chunked_prefill_matches_hf(case, page_size):
    """Chunks smaller than one tile's tokens, so every image is split across several chunks."""
    prompt = build_prompt(case.spec, [5, ("image", 3), 1, ("image", 1), 4], seed=6)
    chunk = case.spec.tokens_per_tile - 1
    torch.testing.assert_close(our_logits(case.ours, prompt, page_size, chunk=chunk), hf_logits(case.hf, prompt),
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefix_cache_hit_matches_hf(case, page_size):
    """B repeats A's image and differs only in its trailing text: B reuses A's KV for a page-aligned prefix that
    ends inside (page_size 4) or just after (page_size 1) the image, and extends the rest."""
    spec = case.spec
    a = build_prompt(spec, [4, ("image", 2), 6], seed=7)
    b = build_prompt(spec, [4, ("image", 2), 6], seed=7)
    b.input_ids[-6:] = torch.tensor([11, 22, 33, 44, 55, 66])
    image_end = 5 + 2 * spec.tokens_per_tile  # </img>
    shared = image_end + 1 if page_size == 1 else (image_end - 2) // page_size * page_size
    assert shared > 5
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
        build_tiny_internvl(p, SPECS["llama_bias"])
    for name in ("model.safetensors", "config.json"):
        assert (paths[0] / name).read_bytes() == (paths[1] / name).read_bytes(), name


def test_real_processor_checkpoint_matches_hf(tmp_path):
    """make_tiny_internvl_checkpoint: AutoProcessor loads an InternVLProcessor; our processor (through the
    registry) gives HF's input_ids and tiles for a wide and a tall image, and our model's logits and greedy
    tokens on our processor's output equal HF's on HF's processor output."""
    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor
    from transformers import InternVLProcessor as HFInternVLProcessor

    from tessera.multimodal.media import MediaLimits
    from tessera.multimodal.processors.internvl import InternVLProcessor
    from tests.multimodal.processor_registry import create_processor

    path = make_tiny_internvl_checkpoint(tmp_path / "ckpt", SPECS["qwen3_tied"], max_patches=4, seed=3)
    hf_processor = AutoProcessor.from_pretrained(path)
    assert isinstance(hf_processor, HFInternVLProcessor)
    hf = load_hf_reference(path)
    ours, config = load_model(path, torch.float32)
    processor = create_processor(hf_processor, config.hf_config, limits=MediaLimits.offline())
    assert isinstance(processor, InternVLProcessor)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (40, 130, 3), dtype=np.uint8)),
              Image.fromarray(rng.integers(0, 256, (90, 50, 3), dtype=np.uint8))]
    content = [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "What is shown here?"}]
    text = hf_processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=False)
    try:
        out = processor.process(prompt=text, image_data=images)
    finally:
        processor.close()
    ref = hf_processor(text=[text], images=images, return_tensors="pt")
    assert out.input_ids == ref["input_ids"][0].tolist()
    assert [it.feature.shape[0] for it in out.mm_inputs.items] == [4, 3]  # 3x1 + thumbnail, 1x2 + thumbnail
    torch.testing.assert_close(torch.cat([it.feature for it in out.mm_inputs.items]), ref["pixel_values"],
                               atol=0, rtol=0)
    inputs = {"input_ids": ref["input_ids"], "pixel_values": ref["pixel_values"]}
    ref_tokens, margin = hf_greedy(hf, inputs, 6)
    assert margin > MIN_MARGIN
    from rope_vlm_testing import VLPrompt

    prompt = VLPrompt(torch.tensor(out.input_ids), out.mm_inputs.items, {"pixel_values": ref["pixel_values"]})
    torch.testing.assert_close(our_logits(ours, prompt, page_size=2), hf(**inputs).logits[0], atol=ATOL, rtol=0)
    assert our_greedy(ours, [prompt], 6, page_size=2) == [ref_tokens]
