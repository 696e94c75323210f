"""Media encoded ahead of their prefill (worker/encode_ahead.py, on by default on a CPU with adaptive threads):
a batch of image requests, some repeating an image, gives HF's tokens with it and without it
(TESSERA_ENCODE_AHEAD=0), and get_server_info says which ran."""

from __future__ import annotations

from tessera import Engine
from tests.engine.hf_reference import chat_prompt, hf_greedy

SP = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def test_encode_ahead_gives_hf_tokens(tiny_gqa, scene_images, monkeypatch):
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(tiny_gqa)
    model = Qwen2VLForConditionalGeneration.from_pretrained(tiny_gqa).eval()
    prompt = chat_prompt(processor, 1, "What color is the circle?")
    images = list(scene_images) + list(scene_images[:2])
    want = [hf_greedy(model, processor, prompt, [image], None, SP["max_new_tokens"])[0] for image in images]
    counts = {}
    for setting, expected in (("1", True), ("0", False)):
        monkeypatch.setenv("TESSERA_ENCODE_AHEAD", setting)
        with Engine(str(tiny_gqa), max_total_tokens=4096, show_progress=False) as eng:
            assert eng.get_server_info()["effective"]["encode_ahead"] is expected
            outs = eng.generate([prompt] * len(images), SP, image_data=[[image] for image in images])
            assert [o["output_ids"] for o in outs] == want, setting
            stats = eng.get_stats()
            counts[setting] = (stats.encoder_cache_misses, stats.encoder_cache_hits)
    # Each distinct image encoded once either way (the repeats are served by the encoder or the prefix cache).
    assert counts["1"] == counts["0"] and counts["1"][0] == len(scene_images)
