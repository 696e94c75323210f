"""Gemma-3 through tessera.Engine (the real scheduler, worker and processor) equals HF generate token for token.

Chunked prefill runs with chunks of 6 tokens, fewer than one image's 16: the scheduler keeps each image run
in one chunk (bidirectional spans are atomic), so every image query still sees its whole image. Pan-and-scan is
on, so wide and tall images carry crops (several runs per item) and the square one none. Repeated images hit
the prefix cache inside one batch and again in a second round.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tessera import Engine
from tests.models.gemma3_testing import SPECS, load_hf_reference, make_tiny_gemma3_checkpoint

MAX_NEW = 6
PAN_AND_SCAN = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 16}


@pytest.fixture(scope="module")
def gemma3_path(tmp_path_factory):
    return make_tiny_gemma3_checkpoint(tmp_path_factory.mktemp("gemma3_engine"), SPECS["gqa"], seed=2)


def _images():
    from PIL import Image

    rng = np.random.default_rng(3)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in ((40, 120), (64, 64),
                                                                                           (90, 36))]


def _prompt(processor, num_images: int, text: str) -> str:
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": text}]
    return processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)


@torch.no_grad()
def _hf_generate(model, processor, prompt: str, images) -> tuple[list[int], int]:
    kwargs = {"images": images, "images_kwargs": PAN_AND_SCAN} if images else {}
    enc = processor(text=[prompt], return_tensors="pt", **kwargs)
    out = model.generate(**enc, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, enc["input_ids"].shape[1]:].tolist(), int(enc["input_ids"].shape[1])


def test_engine_matches_hf_generate_with_small_chunks_and_prefix_hits(gemma3_path):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(gemma3_path)
    hf = load_hf_reference(gemma3_path)
    wide, square, tall = _images()
    cases = [
        (_prompt(processor, 0, "Hello there, how are you?"), None),
        (_prompt(processor, 1, "What is in the image?"), [wide]),
        (_prompt(processor, 2, "Compare the two images."), [square, tall]),
        (_prompt(processor, 1, "What is in the image?"), [square]),
        (_prompt(processor, 1, "What is in the image?"), [wide]),  # a repeat of case 1
        (_prompt(processor, 1, "Describe it in one word."), [wide]),  # the same image, other text
    ]
    expected = [_hf_generate(hf, processor, p, ims) for p, ims in cases]
    assert len({tuple(ids) for ids, _ in expected}) >= 4, "the reference ignores its inputs"
    sp = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
    with Engine(str(gemma3_path), page_size=4, chunked_prefill_size=6, max_running_requests=4,
                max_total_tokens=4096, mm_process_config={"image": PAN_AND_SCAN}, show_progress=False) as engine:
        outs = engine.generate([p for p, _ in cases], sp, image_data=[ims for _, ims in cases])
        for i, ((ids, prompt_len), out) in enumerate(zip(expected, outs)):
            assert out["output_ids"] == ids, f"case {i}"
            assert out["meta_info"]["prompt_tokens"] == prompt_len, f"case {i}"
        # A second round: the wide image's requests start from the prefix cache, past the image.
        again = engine.generate([cases[1][0], cases[5][0]], sp, image_data=[cases[1][1], cases[5][1]])
        for (ids, prompt_len), out in zip((expected[1], expected[5]), again):
            assert out["output_ids"] == ids
            assert out["meta_info"]["cached_tokens"] >= prompt_len // 2
