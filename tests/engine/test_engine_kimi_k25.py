"""Kimi-K2.5 through tessera.Engine (the real scheduler, worker and processor) equals HF generate token for token,
and its images preprocessed on the worker (deferred) give what eager preprocessing gives.

One batch mixes a text-only request with one- and two-image requests of different native sizes, in prefill chunks
of 5 tokens (every image's <|media_pad|> run is split); a repeated image then hits the prefix cache. Deferral:
the frontend processor's `defer_images` is switched between two runs of the same large image (the floor that
keeps small images eager on a CPU set to 0), as tests/engine/test_engine_deferred.py does on demo-vl.
"""

from __future__ import annotations

import pytest

from tests.engine.hf_reference import chat_prompt, hf_generate, noise_images
from tests.models.kimi_k25_testing import SPECS, load_hf_reference, make_tiny_kimi_checkpoint

SP = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def kimi_path(tmp_path_factory):
    return make_tiny_kimi_checkpoint(tmp_path_factory.mktemp("kimi_engine"), SPECS["yarn_qlora"], seed=2,
                                     max_side=12 * 14, max_patches=96)


def test_engine_matches_hf_generate_and_deferred_images_match_eager(kimi_path):
    from transformers import AutoProcessor

    from tessera import Engine

    processor = AutoProcessor.from_pretrained(kimi_path)
    hf = load_hf_reference(kimi_path)
    wide, square, tall = noise_images(((40, 120), (56, 56), (90, 36)))
    cases = [(chat_prompt(processor, 0, "Hello there, how are you?"), None),
             (chat_prompt(processor, 1, "What is in the image?"), [wide]),
             (chat_prompt(processor, 2, "Compare the two images."), [square, tall])]
    expected = [hf_generate(hf, processor, p, ims, SP["max_new_tokens"]) for p, ims in cases]
    assert len({tuple(ids) for ids, _, _ in expected}) == 3, "the reference ignores its inputs"
    large = noise_images(((160, 150),), seed=5)
    with Engine(str(kimi_path), page_size=4, chunked_prefill_size=5, max_running_requests=4, max_total_tokens=4096,
                show_progress=False) as engine:
        outs = engine.generate([p for p, _ in cases], SP, image_data=[ims for _, ims in cases])
        assert [o["output_ids"] for o in outs] == [ids for ids, _, _ in expected]
        assert [o["meta_info"]["prompt_tokens"] for o in outs] == [n for _, n, _ in expected]
        again = engine.generate(cases[1][0], SP, image_data=cases[1][1])
        assert again["output_ids"] == expected[1][0] and again["meta_info"]["cached_tokens"] >= expected[1][1] // 2

        mm = engine.tokenizer_manager.mm_processor
        mm.defer_min_feature_bytes = 0
        prompt = chat_prompt(processor, 1, "Describe it.")
        runs = []
        for defer in (True, False):
            mm.defer_images = defer
            before = engine.get_stats()
            runs.append(engine.generate(prompt, SP, image_data=large))
            engine.flush_cache()
            after = engine.get_stats()
            runs.append((after.mm_deferred_items - before.mm_deferred_items,
                         after.mm_eager_items - before.mm_eager_items))
        deferred, d_counts, eager, e_counts = runs
        assert (d_counts, e_counts) == ((1, 0), (0, 1))
        assert deferred["output_ids"] == eager["output_ids"] == hf_generate(hf, processor, prompt, large, 6)[0]
