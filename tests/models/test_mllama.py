"""Parity of our Mllama (Llama-3.2-Vision) with transformers on a tiny random checkpoint, over the paged KV with the
per-request cross-attention state (models/request_state.py) filled as the worker fills it.

Mllama has its own module instead of a row of test_family_parity: its images are not embeddings merged into
placeholder rows (the suite's protocol: media rows, tower rows per placeholder, prefix cuts after a media span)
but K/V the decoder cross-attends to, filled once per request. The helpers are the suite's (paged_driver,
fixture_checks). Covered: tiles of several aspect ratios (1, 2, 3 and 4 tiles), two images in a prompt (also
back to back), text only, text before the first image, a batch mixing text-only and image rows, small prefill
chunks, and the vision states against HF's.
"""

from __future__ import annotations

import pytest
import torch

from tessera.models.registry import load_model
from tests.models.fixture_checks import MIN_MARGIN, check_greedy_depends_on_inputs, top2_margin
from tests.models.mllama_testing import Driver, build_prompt, build_tiny_mllama, hf_greedy, hf_logits, load_hf_reference

ATOL = 1e-4
PROMPTS = {
    "one_tile": [4, ("image", 28, 28), 5],
    "two_tiles": [3, ("image", 28, 56), 6],  # 1 x 2 tiles
    "three_tiles": [("image", 28, 84), 7],  # 1 x 3, the image first
    "four_tiles": [2, ("image", 56, 60), 4],  # 2 x 2
    "two_images": [3, ("image", 28, 84), 4, ("image", 60, 60), 5],
    "back_to_back": [2, ("image", 28, 56), ("image", 80, 28), 4],  # both images attend to the rest
    "text_only": [9],
}
DECODE = [5, ("image", 40, 70), 6]


@pytest.fixture(scope="module")
def mllama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-mllama")
    build_tiny_mllama(path)
    ours, _ = load_model(path, torch.float32)
    return load_hf_reference(path), ours, path


def test_fixture_can_fail(mllama):
    """The images matter (greedy output changes with the pixels), the text matters, choices are not float noise,
    the vision states are text-sized and the images come in through both gates."""
    hf, ours, _ = mllama

    def build():
        return build_prompt(DECODE, 0)

    base, other_image, other_text = build(), build(), build()
    pixels = torch.randn(other_image.hf_images["pixel_values"].shape, generator=torch.Generator().manual_seed(9))
    other_image.hf_images["pixel_values"] = pixels
    other_image.items[0].feature = pixels[0, 0].clone()
    other_text.input_ids[-4:] = torch.arange(7, 11)
    check_greedy_depends_on_inputs(lambda p: hf_greedy(hf, p, 8), base, other_image, other_text)
    with torch.inference_mode():
        states = ours.get_image_feature(base.items)[0]
    ratio = float(states.pow(2).mean().sqrt() / ours.model.embed_tokens.weight.pow(2).mean().sqrt())
    assert 0.5 < ratio < 2, f"vision states are {ratio:.2f}x the text embeddings' RMS"
    for layer in ours.model.cross_layers():
        assert abs(float(layer.cross_attn_attn_gate.tanh())) > 0.3 and abs(float(layer.cross_attn_mlp_gate.tanh())) > 0.3


def test_vision_states_match_hf_in_one_tower_call(mllama, monkeypatch):
    hf, ours, _ = mllama
    items = build_prompt(PROMPTS["two_images"], 1).items + build_prompt(PROMPTS["two_tiles"], 2).items
    calls = []
    monkeypatch.setattr(ours.vision_model, "forward",
                        lambda *a, _f=ours.vision_model.forward, **k: calls.append(1) or _f(*a, **k))
    with torch.inference_mode():
        got = ours.get_image_feature(items)
        ref = hf.model.multi_modal_projector(hf.model.vision_model(
            pixel_values=torch.stack([it.feature for it in items])[None],
            aspect_ratio_ids=torch.stack([it.model_specific_data["aspect_ratio_id"] for it in items])[None],
            aspect_ratio_mask=torch.stack([it.model_specific_data["aspect_ratio_mask"] for it in items])[None],
        ).last_hidden_state)[0].flatten(1, 2)
    assert len(calls) == 1
    assert sorted(int(it.model_specific_data["aspect_ratio_mask"].sum()) for it in items) == [2, 3, 4]
    torch.testing.assert_close(torch.stack(got), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", PROMPTS)
def test_prefill_logits_match_hf(mllama, name):
    hf, ours, _ = mllama
    prompt = build_prompt(PROMPTS[name], 3)
    ref = hf_logits(hf, prompt)
    (_, [logits]) = Driver(ours, page_size=4).greedy([prompt], 0)
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    assert top2_margin(ref[-1]) > MIN_MARGIN


@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_decode_matches_hf(mllama, page_size):
    hf, ours, _ = mllama
    prompt = build_prompt(DECODE, 0)
    ref, margin = hf_greedy(hf, prompt, 10)
    assert margin > MIN_MARGIN
    assert Driver(ours, page_size).greedy([prompt], 10)[0] == [ref]


def test_mixed_batch_of_text_only_and_image_requests_matches_hf(mllama):
    """A text-only request (no cross-attention state: the cross layers skip its rows), one image and two images,
    prefilled in one forward (the text-only row in the middle), then decoded together."""
    hf, ours, _ = mllama
    prompts = [build_prompt(PROMPTS["two_images"], 11), build_prompt([6], 5), build_prompt(DECODE, 3)]
    refs = [hf_greedy(hf, p, 6) for p in prompts]
    assert min(m for _, m in refs) > MIN_MARGIN
    tokens, logits = Driver(ours, page_size=4).greedy(prompts, 6)
    for p, lo in zip(prompts, logits):
        torch.testing.assert_close(lo, hf_logits(hf, p), atol=ATOL, rtol=0)
    assert tokens == [t for t, _ in refs]


@pytest.mark.parametrize("chunk,page_size", [(3, 1), (5, 4)])
def test_chunked_prefill_matches_hf(mllama, chunk, page_size):
    """Chunks of a few tokens: the text before the first image, the image tokens and the text after them land
    in different steps; the state is filled once, before the first chunk."""
    hf, ours, _ = mllama
    prompts = [build_prompt(PROMPTS["two_images"], 6), build_prompt([4], 7)]
    refs = [hf_greedy(hf, p, 4) for p in prompts]
    tokens, logits = Driver(ours, page_size).greedy(prompts, 4, chunk=chunk)
    for p, lo in zip(prompts, logits):
        torch.testing.assert_close(lo, hf_logits(hf, p), atol=ATOL, rtol=0)
    assert tokens == [t for t, _ in refs]


def test_text_before_the_first_image_reads_every_state_row_as_hf(mllama, monkeypatch):
    """Rows that attend to no image are transformers' quirk (every state row unmasked, padding tiles included,
    only the MLP zeroed): letting them read one row instead moves their logits."""
    import tessera.models.mllama as mod

    hf, ours, _ = mllama
    prompt = build_prompt([6, ("image", 30, 70), 3], 4)
    ref = hf_logits(hf, prompt)
    real = mod.CrossPlan.of

    def one_key_for_text_before_images(fb):
        plan = real(fb)
        if plan is not None:
            for mask, (lo, hi) in zip(plan.masks, plan.rows):
                before = ~plan.attends[lo:hi, 0]
                mask[0, 0, before] = False
                mask[0, 0, before, 0] = True
        return plan

    monkeypatch.setattr(mod.CrossPlan, "of", staticmethod(one_key_for_text_before_images))
    (_, [moved]) = Driver(ours).greedy([prompt], 0)
    assert (moved[:6] - ref[:6]).abs().max() > 100 * ATOL
    monkeypatch.undo()
    (_, [logits]) = Driver(ours).greedy([prompt], 0)
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)


def test_language_model_only_loads_without_the_tower(mllama):
    hf, _, path = mllama
    ours, _ = load_model(path, torch.float32, language_model_only=True)
    assert ours.vision_model is None and ours.encoders() == {}
    prompt = build_prompt(PROMPTS["text_only"], 2)
    (tokens, [logits]) = Driver(ours).greedy([prompt], 5)
    torch.testing.assert_close(logits, hf_logits(hf, prompt), atol=ATOL, rtol=0)
    assert tokens == [hf_greedy(hf, prompt, 5)[0]]


def test_inconsistent_config_is_refused_before_weights_load(tmp_path):
    """A checkpoint whose cross-attention layer indices fall outside the text model names the field."""
    from tessera.models.config import ModelConfig
    from tessera.models.mllama import MllamaForConditionalGeneration
    from tests.models.mllama_testing import tiny_mllama_config

    cfg = ModelConfig.from_hf(tiny_mllama_config(cross_attention_layers=[1, 7]))
    with pytest.raises(ValueError, match="cross_attention_layers"):
        MllamaForConditionalGeneration(cfg)


def test_the_cross_attention_state_counts_in_the_pool_budget():
    """A request's images take their state rows out of the pool before its tokens: an omitted max_tokens leaves
    room for them, an explicit one that does not fit is refused naming the field (text-only: no rows)."""
    from tessera.frontend.prompt_checks import check_lengths
    from tessera.frontend.request import GenerateRequest
    from tessera.messages.items import MultimodalInputs
    from tessera.messages.sampling import SamplingParams
    from tessera.models.config import ModelConfig
    from tests.models.mllama_testing import tiny_mllama_config

    config = ModelConfig.from_hf(tiny_mllama_config())
    prompt = build_prompt(PROMPTS["two_images"], 0)
    mm, ids = MultimodalInputs(prompt.items), prompt.input_ids.tolist()
    rows = 2 * 4 * 5  # two images, 4 tiles each, 2 x 2 patches + the class token per tile
    req = GenerateRequest(input_ids=ids, auto_max_new_tokens=True)
    check_lengths(req, ids, mm, config, 512, 100)
    assert req.sampling_params.max_new_tokens == 100 - rows - len(ids)
    req = GenerateRequest(input_ids=ids, sampling_params=SamplingParams(max_new_tokens=100 - rows - len(ids) + 1))
    with pytest.raises(ValueError, match=rf"max_new_tokens: .* cross-attention K/V \({rows}\)"):
        check_lengths(req, ids, mm, config, 512, 100)
    check_lengths(GenerateRequest(input_ids=ids, sampling_params=SamplingParams(max_new_tokens=100 - len(ids))),
                  ids, None, config, 512, 100)


def test_int8_weights_match_hf_dequantized(mllama, monkeypatch):
    """--torchao-config int8wo quantizes every language-model linear, cross-attention's included (the tower and
    the projector stay float): our logits and greedy tokens are HF's over the same weights dequantized. (int4's
    groups of 32+ do not divide the fixture's widths of 48 and 72.)"""
    from tessera.layers import half_linear
    from tessera.layers.quantization.int_linear import fake_quantize_

    monkeypatch.setattr(half_linear, "_BF16_COMPUTE", False)  # HF's products are float32: ours too, on any CPU
    _, _, path = mllama
    scheme = "int8wo"
    ours, _ = load_model(path, torch.float32, torchao_config=scheme)
    hf = load_hf_reference(path)
    prompt = build_prompt(DECODE, 0)
    float_logits = hf_logits(hf, prompt)
    assert fake_quantize_(hf, scheme, "model.language_model.") == 3 * 7 + 2 * 7  # q k v o gate up down per layer
    ref = hf_logits(hf, prompt)
    assert (ref - float_logits).abs().max() > 1e-3, "the quantization must change the model"
    tokens, [logits] = Driver(ours).greedy([prompt], 6)
    torch.testing.assert_close(logits, ref, atol=ATOL, rtol=0)
    assert tokens == [hf_greedy(hf, prompt, 6)[0]]
