"""Gemma-3 through tessera.Engine (the real scheduler, worker and processor) equals HF generate token for token.

Chunked prefill runs with chunks of 6 tokens, fewer than one image's 16: the scheduler keeps each image run
in one chunk (bidirectional spans are atomic), so every image query still sees its whole image. Pan-and-scan is
on, so wide and tall images carry crops (several runs per item) and the square one none. Repeated images hit
the prefix cache inside one batch and again in a second round.
"""

from __future__ import annotations

import pytest

from tests.engine.hf_reference import (
    chat_prompt,
    check_engine_matches_hf_generate,
    noise_images,
)
from tests.models.gemma3_testing import (
    SPECS,
    load_hf_reference,
    make_tiny_gemma3_checkpoint,
)

PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}


@pytest.fixture(scope="module")
def gemma3_path(tmp_path_factory):
    return make_tiny_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3_engine"), SPECS["gqa"], seed=2)


def test_engine_matches_hf_generate_with_small_chunks_and_prefix_hits(gemma3_path):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(gemma3_path)
    wide, square, tall = noise_images(((40, 120), (64, 64), (90, 36)))
    cases = [
        (chat_prompt(processor, 0, "Hello there, how are you?"), None),
        (chat_prompt(processor, 1, "What is in the image?"), [wide]),
        (chat_prompt(processor, 2, "Compare the two images."), [square, tall]),
        (chat_prompt(processor, 1, "What is in the image?"), [square]),
        (chat_prompt(processor, 1, "What is in the image?"), [wide]),  # a repeat of case 1
        (chat_prompt(processor, 1, "Describe it in one word."), [wide]),  # the same image, other text
    ]
    # The second round: the wide image's requests start from the prefix cache, past the image.
    check_engine_matches_hf_generate(gemma3_path, load_hf_reference(gemma3_path), processor, cases,
                                     second_round=(1, 5), min_distinct=4, chunked_prefill_size=6,
                                     images_kwargs=PAN_AND_SCAN, mm_process_config={"image": PAN_AND_SCAN})
