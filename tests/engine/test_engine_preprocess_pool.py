"""--mm-preprocess-workers: media preprocessed in worker processes gives HF's tokens, the routed workers'
preprocessing caches hit on repeats (counters summed into the frontend's stats), bad media is still a
MediaError naming the problem, and flush_cache empties the workers' caches."""

from __future__ import annotations

import pytest

import time

from tessera import Engine
from tessera.frontend.preprocess_pool import PreprocessPool, route_digest
from tessera.frontend.tokenizer_manager import RECV_POLL_MS
from tessera.multimodal.media import MediaError
from tests.engine.hf_reference import chat_prompt, hf_greedy
from tests.multimodal.deferred_testing import noise_image

SP = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def test_route_digest_follows_content():
    a, b = noise_image(64, 48, seed=1), noise_image(64, 48, seed=2)
    assert route_digest(a) == route_digest([noise_image(64, 48, seed=1)]) != route_digest(b)
    assert route_digest(None, b"xyz") == route_digest([], [b"xyz"]) != route_digest(b"xyw")
    assert route_digest("data:image/png;base64,AAAA") != route_digest("data:image/png;base64,AAAB")
    assert route_digest({"format": "processor_output"}) is None and route_digest(None, None, None) is None


@pytest.mark.slow  # an Engine plus two spawned worker processes (~15 s on 2 busy cores)
def test_pool_matches_hf_and_its_caches_hit(tiny_gqa, scene_images, monkeypatch):
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    # The workers still loading after the receive loop's first poll timeout: the loop once took the engine
    # being not yet ready for every scheduler having died, and stopped (so every request hung, now and then).
    wait_ready = PreprocessPool.wait_ready

    def slow_wait_ready(self, timeout=None):
        time.sleep(3 * RECV_POLL_MS / 1000)
        wait_ready(self, timeout)

    monkeypatch.setattr(PreprocessPool, "wait_ready", slow_wait_ready)

    processor = AutoProcessor.from_pretrained(tiny_gqa)
    model = Qwen2VLForConditionalGeneration.from_pretrained(tiny_gqa).eval()
    prompt = chat_prompt(processor, 1, "What color is the circle?")
    # Eager preprocessing, so that the workers' preprocessing caches are consulted.
    with Engine(str(tiny_gqa), mm_preprocess_workers=2, disable_deferred_mm_preprocessing=True,
                max_total_tokens=4096, show_progress=False) as eng:
        assert len(eng.tokenizer_manager.preprocess_pool) == 2
        for image in scene_images[:2]:
            want = hf_greedy(model, processor, prompt, [image], None, SP["max_new_tokens"])[0]
            first = eng.generate(prompt, SP, image_data=image)
            again = eng.generate(prompt, SP, image_data=image)
            assert first["output_ids"] == again["output_ids"] == want
        stats = eng.get_frontend_stats()
        assert (stats.preprocess_cache_misses, stats.preprocess_cache_hits) == (2, 2)
        assert stats.preprocess_cache_entries == 2
        with pytest.raises(MediaError, match="not a recognised image"):
            eng.generate(prompt, SP, image_data=b"not an image")
        eng.flush_cache()
        assert eng.get_frontend_stats().preprocess_cache_entries == 0
