"""InternVL through tessera.Engine (the real scheduler, worker and processor) equals HF generate token for token.

Chunked prefill runs with chunks of 5 tokens, fewer than one tile's 9 context tokens, so every image is split
across chunks (InternVL's image spans are causal, not atomic). Tiled images (wide, tall) and a one-tile square
one are batched with a text-only request; repeated images hit the prefix cache inside one batch and again in a
second round.
"""

from __future__ import annotations

import pytest

from tests.engine.hf_reference import (
    chat_prompt,
    check_engine_matches_hf_generate,
    noise_images,
)
from tests.models.internvl_testing import (
    SPECS,
    load_hf_reference,
    make_tiny_internvl_checkpoint,
)


@pytest.fixture(scope="module")
def internvl_path(tmp_path_factory):
    return make_tiny_internvl_checkpoint(tmp_path_factory.mktemp("internvl_engine"), SPECS["qwen2_gqa"],
                                        max_patches=4, seed=2)


def test_engine_matches_hf_generate_with_small_chunks_and_prefix_hits(internvl_path):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(internvl_path)
    wide, square, tall = noise_images(((40, 120), (48, 48), (90, 36)))
    cases = [
        (chat_prompt(processor, 0, "Hello there, how are you?"), None),
        (chat_prompt(processor, 1, "What is in the image?"), [wide]),
        (chat_prompt(processor, 2, "Compare the two images."), [square, tall]),
        (chat_prompt(processor, 1, "What is in the image?"), [wide]),  # a repeat of case 1
        (chat_prompt(processor, 1, "Describe it in one word."), [wide]),  # the same image, other text
    ]
    check_engine_matches_hf_generate(internvl_path, load_hf_reference(internvl_path), processor, cases,
                                     second_round=(1, 4), min_distinct=3, chunked_prefill_size=5)
