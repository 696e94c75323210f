"""Pixtral (LLaVA with a Pixtral tower) through tessera.Engine (the real scheduler, worker and processor)
equals HF generate token for token.

Chunked prefill runs with chunks of 5 tokens, so every image (rows of [IMG] tokens separated by [IMG_BREAK])
is split across chunks, inside rows and between them (Pixtral's image spans are causal, not atomic). Images of
three sizes (wide, square, tall: each its own patch grid) are batched with a text-only request, so one step
encodes images of different sizes together; repeated images hit the prefix cache inside one batch and again
in a second round.
"""

from __future__ import annotations

import pytest

from tests.engine.hf_reference import (
    chat_prompt,
    check_engine_matches_hf_generate,
    noise_images,
)
from tests.models.pixtral_testing import (
    SPECS,
    load_hf_reference,
    make_tiny_pixtral_checkpoint,
)


@pytest.fixture(scope="module")
def pixtral_path(tmp_path_factory):
    return make_tiny_pixtral_checkpoint(tmp_path_factory.mktemp("pixtral_engine"), SPECS["mistral_gqa"], seed=2)


def _prompt(processor, num_images: int, text: str) -> str:
    return chat_prompt(processor, num_images, text, add_generation_prompt=False)


def test_engine_matches_hf_generate_with_small_chunks_and_prefix_hits(pixtral_path):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(pixtral_path)
    wide, square, tall = noise_images(((40, 120), (48, 48), (90, 36)))
    cases = [
        (_prompt(processor, 0, "Hello there, how are you?"), None),
        (_prompt(processor, 1, "What is in the image?"), [wide]),
        (_prompt(processor, 2, "Compare the two images."), [square, tall]),
        (_prompt(processor, 1, "What is in the image?"), [wide]),  # a repeat of case 1
        (_prompt(processor, 1, "Describe it in one word."), [wide]),  # the same image, other text
    ]
    check_engine_matches_hf_generate(pixtral_path, load_hf_reference(pixtral_path), processor, cases,
                                     second_round=(1, 4), min_distinct=3, chunked_prefill_size=5)
