"""Parity of our paged LLaVA-NeXT with transformers on tiny random checkpoints (Llama untied; Qwen2 tied with two
feature layers concatenated).

Images of many aspect ratios (wide, tall, square, extreme, exactly one tile) pick different grid pinpoints, so
their tile grids, unpadding and newline counts differ; each one's placeholder count is our
LlavaImageGeometry.num_image_tokens, which HF's model checks against its own features in every reference call.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.models.llava_next import modeling_llava_next as hf_next
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

from tessera.models.config import ModelConfig
from tessera.models.llava import LlavaImageGeometry
from tessera.models.llava_next import LlavaNextForConditionalGeneration

SIZES = {"wide": (30, 70), "tall": (70, 30), "square": (50, 50), "very_wide": (20, 90), "very_tall": (90, 21),
         "one_tile": (28, 28), "tiny": (3, 5), "sliver": (1, 90)}  # a sliver unpads to 0 or 1 grid rows
DECODE_PROMPT = [3, ("image", SIZES["wide"]), 5]


@pytest.fixture(scope="module", params=["next_llama", "next_qwen2"])
def case(request, tmp_path_factory) -> Case:
    spec = SPECS[request.param]
    return load_case(spec, tmp_path_factory.mktemp(f"llava_{spec.name}"), DECODE_PROMPT)


@pytest.mark.parametrize("size_name", list(SIZES))
def test_prefill_logits_match_hf_for_every_aspect_ratio(case, size_name):
    check_prefill(case, build_prompt(case.spec, [4, ("image", SIZES[size_name]), 3], seed=1))


def test_prefill_text_only_and_two_images(case):
    check_prefill(case, build_prompt(case.spec, [12], seed=2))
    check_prefill(case, build_prompt(case.spec, [2, ("image", SIZES["tall"]), 2, ("image", SIZES["very_wide"]), 2],
                                     seed=3), page_size=4)


def test_image_features_match_hf_in_one_tower_call(case):
    parts = [p for size in SIZES.values() for p in (1, ("image", size))]
    prompt = build_prompt(case.spec, parts, seed=4)
    counts = {it.num_tokens for it in prompt.items}
    assert len(counts) >= 4, f"the sizes should give different token counts, got {counts}"
    check_image_features(case, prompt)


@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_decode_matches_hf(case, page_size):
    check_decode(case, build_prompt(case.spec, DECODE_PROMPT, seed=5), page_size)


def test_two_requests_of_mixed_lengths_in_one_batch(case):
    check_batch(case, [build_prompt(case.spec, [2, ("image", SIZES["square"]), 1, ("image", SIZES["tall"]), 3], seed=6),
                       build_prompt(case.spec, [5, ("image", SIZES["one_tile"]), 2], seed=7)])


def test_chunked_prefill_matches_hf(case):
    prompt = build_prompt(case.spec, [3, ("image", SIZES["very_tall"]), 2, ("image", SIZES["wide"]), 3], seed=8)
    check_chunked_prefill(case, prompt, chunk=13, page_size=2)


@pytest.mark.parametrize("page_size", [1, 4])
def test_prefix_cache_hit_on_repeated_image(case, page_size):
    parts = [4, ("image", SIZES["wide"]), 6]
    a, b = build_prompt(case.spec, parts, seed=9), build_prompt(case.spec, parts, seed=9)
    b.input_ids[-6:] = torch.tensor([11, 22, 33, 44, 55, 66])
    start, end = a.items[0].offsets[0]
    shared = end if page_size == 1 else end - end % page_size - page_size  # a page-aligned cut inside the image
    assert shared > start
    check_prefix_cache_hit(case, a, b, shared, page_size)


def test_tile_counts_follow_the_config(case):
    g = LlavaImageGeometry.from_config(case.hf.config)
    assert g.grid_pinpoints == tuple(tuple(p) for p in case.spec.grid_pinpoints)
    for size in SIZES.values():
        assert g.num_tiles(size) == hf_next.image_size_to_num_patches(list(size), case.spec.grid_pinpoints,
                                                                       case.spec.image_size)
    assert g.num_tiles(SIZES["square"]) == 5  # a 2x2 grid + the base tile
    assert case.ours.image_newline is not None and case.ours.image_newline.shape == (case.spec.hidden,)


def test_full_strategy_with_a_cls_tower_is_refused():
    spec = dataclasses.replace(SPECS["next_llama"], strategy="full")
    config = ModelConfig.from_hf(tiny_llava_config(spec))
    with pytest.raises(ValueError, match="CLS token"):
        LlavaNextForConditionalGeneration(config)
