"""anyres helpers against transformers' LLaVA-NeXT implementations (the oracle)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.image_processing_utils import get_patch_output_size as hf_patch_output_size
from transformers.image_processing_utils import select_best_resolution as hf_select
from transformers.image_utils import ChannelDimension
from transformers.models.llava_next import modeling_llava_next as hf
from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor

from tessera.multimodal import anyres

PINPOINTS = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]]
GRIDS = st.lists(st.tuples(st.integers(1, 8), st.integers(1, 8)), min_size=1, max_size=6)
SIDE = st.integers(1, 3000)


@settings(max_examples=150, deadline=None, database=None)
@given(SIDE, SIDE, GRIDS, st.sampled_from([112, 224, 336]))
def test_select_best_resolution_matches_hf(h, w, grid, tile):
    candidates = [[a * tile, b * tile] for a, b in grid]
    assert anyres.select_best_resolution((h, w), candidates) == tuple(hf_select((h, w), candidates))
    assert anyres.get_anyres_image_grid_shape((h, w), candidates, tile) == tuple(
        hf.get_anyres_image_grid_shape([h, w], candidates, tile))
    assert anyres.image_size_to_num_patches((h, w), candidates, tile) == hf.image_size_to_num_patches(
        [h, w], candidates, tile)


@settings(max_examples=150, deadline=None, database=None)
@given(SIDE, SIDE, st.integers(1, 5), st.integers(1, 5))
def test_unpadded_feature_counts_match_hf(h, w, scale_h, scale_w):
    patches = 24  # 336 / 14
    ours = anyres.get_unpadded_features(h, w, patches, patches, scale_h, scale_w)
    assert ours == tuple(LlavaNextProcessor._get_unpadded_features(None, h, w, patches, patches, scale_h, scale_w))
    feature_map = torch.zeros(1, patches * scale_h, patches * scale_w)
    unpadded = anyres.unpad_image(feature_map, (h, w))
    assert unpadded.shape == hf.unpad_image(feature_map, [h, w]).shape
    assert unpadded.shape[1] * unpadded.shape[2] == ours[0] and unpadded.shape[1] == ours[1]


@settings(max_examples=100, deadline=None, database=None)
@given(SIDE, SIDE, st.sampled_from(PINPOINTS))
def test_patch_output_size_matches_hf(h, w, target):
    image = np.zeros((h, w, 3), np.uint8)
    assert anyres.get_patch_output_size((h, w), target) == tuple(
        hf_patch_output_size(image, target, ChannelDimension.LAST))


@pytest.mark.parametrize(("h", "w"), [(336, 336), (480, 640), (1000, 200), (50, 2000), (777, 778)])
def test_token_count_matches_hf_processor_formula(h, w):
    class _Proc:  # the attributes LlavaNextProcessor._get_number_of_features reads
        patch_size = 14
        num_additional_image_tokens = 1

        class image_processor:  # noqa: N801
            image_grid_pinpoints = PINPOINTS

        _get_unpadded_features = LlavaNextProcessor._get_unpadded_features

    expected = LlavaNextProcessor._get_number_of_features(_Proc(), h, w, 336, 336)
    assert anyres.get_anyres_num_image_tokens((h, w), PINPOINTS, 336, 14, num_additional_tokens=1) == expected


def test_rejects_bad_sizes():
    with pytest.raises(ValueError, match="positive"):
        anyres.select_best_resolution((0, 10), PINPOINTS)
    with pytest.raises(ValueError, match="empty"):
        anyres.select_best_resolution((10, 10), [])
