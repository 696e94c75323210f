"""Deferred image preprocessing end to end on demo-vl with its resolution kept (max_pixels raised, as the
payload benchmark runs it): the same greedy tokens as eager preprocessing, a fraction of the payload, and
prefix/encoder cache entries shared between the two paths (an item's hash does not depend on the path).

One Engine; the frontend processor's `defer_images` is switched between requests to get both paths."""

from __future__ import annotations

import pytest

from tessera import Engine
from tests.engine.hf_reference import chat_prompt
from tests.multimodal.deferred_testing import noise_image

SP = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
pytestmark = pytest.mark.slow  # a demo-vl Engine of its own (~10 s to start on 2 busy cores)


@pytest.fixture(scope="module")
def engine():
    with Engine("demo-vl", mm_process_config={"image": {"max_pixels": 1572864}}, max_total_tokens=8192,
                show_progress=False) as eng:
        yield eng


def _run(engine, prompt, images, defer: bool):
    engine.tokenizer_manager.mm_processor.defer_images = defer
    before = engine.get_stats()
    out = engine.generate(prompt, SP, image_data=images)
    after = engine.get_stats()
    sent = after.mm_transport_bytes["image"] - before.mm_transport_bytes["image"]
    assert after.mm_transport_bytes_total - before.mm_transport_bytes_total == sent  # images only here
    return out, sent, (after.mm_deferred_items - before.mm_deferred_items, after.mm_eager_items - before.mm_eager_items)


def test_large_images_deferred_equal_eager_with_a_fraction_of_the_payload(engine):
    processor = engine.tokenizer_manager.info.hf_processor
    images = [noise_image(644, 476, seed=1), noise_image(420, 700, seed=2)]
    prompt = chat_prompt(processor, 2, "Describe the images.")
    try:
        deferred, d_bytes, d_counts = _run(engine, prompt, images, defer=True)
        engine.flush_cache()
        eager, e_bytes, e_counts = _run(engine, prompt, images, defer=False)
    finally:
        engine.tokenizer_manager.mm_processor.defer_images = True
    assert (d_counts, e_counts) == ((2, 0), (0, 2))
    assert eager["meta_info"]["cached_tokens"] == 0  # the flush made the eager run compute everything again
    assert deferred["output_ids"] == eager["output_ids"]
    assert deferred["meta_info"]["prompt_tokens"] == eager["meta_info"]["prompt_tokens"] > 600
    assert 0 < d_bytes < 0.3 * e_bytes


def test_deferred_and_eager_share_prefix_and_encoder_cache_entries(engine):
    processor = engine.tokenizer_manager.info.hf_processor
    image = noise_image(560, 420, seed=3)
    prompt = chat_prompt(processor, 1, "What is this?")
    try:
        eager, _, _ = _run(engine, prompt, [image], defer=False)
        deferred, _, counts = _run(engine, prompt, [image], defer=True)
        assert counts == (1, 0)
        assert deferred["meta_info"]["cached_tokens"] == deferred["meta_info"]["prompt_tokens"] - 1
        assert deferred["output_ids"] == eager["output_ids"]
        # Another system prompt: no prefix to share, but the eager run's image embedding is reused.
        s0 = engine.get_stats()
        _run(engine, chat_prompt(processor, 1, "What is this?", system="Be brief."), [image],
                             defer=True)
        s1 = engine.get_stats()
        assert (s1.encoder_cache_hits - s0.encoder_cache_hits, s1.encoder_cache_misses - s0.encoder_cache_misses) \
            == (1, 0)
    finally:
        engine.tokenizer_manager.mm_processor.defer_images = True
