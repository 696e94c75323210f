"""Our M-RoPE position helpers against transformers' Qwen2VLModel.get_rope_index."""

from __future__ import annotations

import pytest
import torch
from qwen2_vl_testing import IMAGE_ID, MERGE, VIDEO_ID, VSTART_ID, build_prompt, hf_positions

from tessera.messages.items import Modality
from tests.models.mrope_reference import compute_mrope_positions, decode_mrope_positions, text_mrope_positions

SPECS = [
    [9],
    [5, ("image", (1, 4, 6)), 4],
    [3, ("image", (1, 4, 6)), 2, ("image", (1, 2, 4)), 3],
    [("image", (1, 6, 2)), 1],
    [4, ("video", (2, 4, 4)), 3, ("image", (1, 2, 2))],
    [2, ("video", (6, 2, 2)), 3],  # temporal extent larger than the spatial one
]


def ours(prompt):
    return compute_mrope_positions(prompt.input_ids, prompt.grids(Modality.IMAGE), prompt.grids(Modality.VIDEO),
                                   MERGE, IMAGE_ID, VIDEO_ID, VSTART_ID)


@pytest.mark.parametrize("vl_case", ["gqa"], indirect=True)
@pytest.mark.parametrize("spec", SPECS, ids=range(len(SPECS)))
def test_compute_mrope_positions_matches_hf(vl_case, spec):
    prompt = build_prompt(spec)
    pos, delta = ours(prompt)
    ref_pos, ref_delta = hf_positions(vl_case.hf, prompt)
    assert torch.equal(pos, ref_pos)
    assert delta == ref_delta


def test_grid_and_placeholder_disagreement_raises():
    prompt = build_prompt([2, ("image", (1, 4, 4)), 2])
    with pytest.raises(ValueError, match="image"):
        compute_mrope_positions(prompt.input_ids, [[1, 4, 6]], None, MERGE, IMAGE_ID, VIDEO_ID)
    with pytest.raises(ValueError, match="image_grid_thw"):
        compute_mrope_positions(prompt.input_ids, [[1, 4, 4], [1, 2, 2]], None, MERGE, IMAGE_ID, VIDEO_ID)


def test_decode_and_text_positions_continue_the_prompt():
    prompt = build_prompt([3, ("image", (1, 4, 6)), 2])
    pos, delta = ours(prompt)
    n = prompt.input_ids.shape[0]
    assert delta < 0  # an image takes fewer positions than tokens
    assert decode_mrope_positions(n, delta).tolist() == [[n + delta]] * 3
    text = text_mrope_positions(n, 4, delta)
    assert text.shape == (3, 4) and text[:, 0].tolist() == [int(pos.max()) + 1] * 3
    assert torch.equal(text[0], torch.arange(n, n + 4) + delta) and torch.equal(text[0], text[2])
