"""Parity of our paged LLaVA-1.5 with transformers on tiny random checkpoints.

Three language models from text_config (Llama with attention biases, Mistral with a sliding window shorter than
the prompts and tied embeddings, Qwen2 with q/k/v biases), and three feature selections (layer -2 without CLS;
layers [-3, -1] concatenated with CLS kept ("full"); the last layer); CLIP towers, and one SigLIP
tower. Embeddings come from our encoder; everything
runs over the paged KV test driver (tests/models/paged_driver.py).
"""

from __future__ import annotations

import pytest
import torch
from llava_testing import (
    SPECS,
    Case,
    build_prompt,
    check_batch,
    check_chunked_prefill,
    check_decode,
    check_image_features,
    check_prefill,
    check_prefix_cache_hit,
    load_case,
    tiny_llava_config,
)
from transformers import GemmaConfig

from tessera.models.llava import LlavaImageGeometry
from tessera.models.registry import load_model

IMAGE = ("image", (0, 0))  # LLaVA-1.5: every image is one crop, its original size does not matter
PROMPTS = {
    "text": [14],
    "one_image": [5, IMAGE, 4],
    "two_images": [3, IMAGE, 2, IMAGE, 3],
}
DECODE_PROMPT = [3, IMAGE, 5]


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def case(request, tmp_path_factory) -> Case:
    spec = SPECS[request.param]
    return load_case(spec, tmp_path_factory.mktemp(f"llava_{spec.name}"), DECODE_PROMPT)


@pytest.mark.parametrize("prompt_name", list(PROMPTS))
def test_prefill_logits_match_hf(case, prompt_name):
    check_prefill(case, build_prompt(case.spec, PROMPTS[prompt_name], seed=1))


def test_image_features_match_hf_in_one_tower_call(case):
    check_image_features(case, build_prompt(case.spec, [1, IMAGE, 1, IMAGE, 1, IMAGE], seed=2))


@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_decode_matches_hf(case, page_size):
    check_decode(case, build_prompt(case.spec, DECODE_PROMPT, seed=3), page_size)


def test_two_requests_of_mixed_lengths_in_one_batch(case):
    check_batch(case, [build_prompt(case.spec, PROMPTS["two_images"], seed=4), build_prompt(case.spec, [2, IMAGE, 9],
                                                                                            seed=5)])


def test_chunked_prefill_matches_hf(case):
    prompt = build_prompt(case.spec, [3, IMAGE, 2, IMAGE, 3], seed=6)
    check_chunked_prefill(case, prompt, chunk=4, page_size=2)


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefix_cache_hit_on_repeated_image(case, page_size):
    a = build_prompt(case.spec, [4, IMAGE, 6], seed=7)
    b = build_prompt(case.spec, [4, IMAGE, 6], seed=7)
    b.input_ids[-6:] = torch.tensor([11, 22, 33, 44, 55, 66])
    image_end = a.items[0].offsets[0][1]
    shared = image_end if page_size == 1 else image_end - image_end % page_size - page_size  # cut inside the image
    assert shared > a.items[0].offsets[0][0]
    check_prefix_cache_hit(case, a, b, shared, page_size)


def test_language_model_only_serves_text(case):
    ours, _ = load_model(case.path, torch.float32, language_model_only=True)
    assert ours.vision_tower is None and ours.encoders() == {}
    check_prefill(Case(case.spec, case.hf, ours, case.path), build_prompt(case.spec, PROMPTS["text"], seed=8))


def test_geometry_and_options_follow_the_config(case):
    spec = case.spec
    g = LlavaImageGeometry.from_config(case.hf.config)
    side = spec.image_size // spec.patch
    assert g.tokens_per_tile == side * side + (spec.strategy == "full")
    assert case.ours.vision_feature_layer == (spec.feature_layer if isinstance(spec.feature_layer, int)
                                              else list(spec.feature_layer))
    attn = case.ours.model.layers[0].self_attn
    has_bias = {"llama": (True, True), "mistral": (False, False), "qwen2": (True, False)}[spec.text_type]
    assert (attn.qkv_proj.bias is not None, attn.o_proj.bias is not None) == has_bias
    windows = case.ours.config.sliding_windows
    assert windows == ((12,) * spec.layers if spec.text_type == "mistral" else (None,) * spec.layers)


def test_siglip_tower_without_cls(tmp_path):
    """A SigLIP tower (no CLS token: "default" drops its first patch, as transformers does), one spec only."""
    case = load_case(SPECS["siglip"], tmp_path, DECODE_PROMPT)
    assert case.ours.geometry.tokens_per_tile == 4 * 4 - 1
    check_image_features(case, build_prompt(case.spec, [1, IMAGE, 1, IMAGE], seed=10))
    check_prefill(case, build_prompt(case.spec, PROMPTS["two_images"], seed=11))
    check_decode(case, build_prompt(case.spec, DECODE_PROMPT, seed=12), page_size=2)


def test_unknown_language_models_and_towers_are_refused_by_name():
    import dataclasses

    from tessera.models.config import ModelConfig
    from tessera.models.llava import LlavaForConditionalGeneration

    cfg = tiny_llava_config(SPECS["llama"])
    cfg.text_config = GemmaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    with pytest.raises(NotImplementedError, match="gemma"):
        LlavaForConditionalGeneration(ModelConfig.from_hf(cfg))
    cfg = tiny_llava_config(dataclasses.replace(SPECS["llama"], text_extra=(("mlp_bias", True),)))
    with pytest.raises(NotImplementedError, match="mlp_bias"):
        LlavaForConditionalGeneration(ModelConfig.from_hf(cfg))
    cfg = tiny_llava_config(SPECS["llama"])
    cfg.vision_config.model_type = "made_up_vision_model"
    with pytest.raises(NotImplementedError, match="made_up_vision_model"):
        LlavaImageGeometry.from_config(cfg)
