"""The multimodal pipeline through tessera.Engine: the three input formats, the caches seen
through their counters, bad media refused without disturbing good requests, and
language-model-only serving. HF transformers (greedy, same tiny checkpoint) is the oracle.

One shared Engine serves most tests (module scope); test order does not matter because
every counter check is a difference taken inside one test, on images no other test uses.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tessera import Engine
from tests.engine.hf_reference import chat_prompt, hf_greedy
from tests.multimodal.conftest import encode_mp4, encode_png

MAX_NEW = 8
SP = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
QUESTION = "What color is the circle?"


@pytest.fixture(scope="module")
def hf(tiny_gqa):
    """(processor, model) of the tiny checkpoint, loaded with transformers."""
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    return AutoProcessor.from_pretrained(tiny_gqa), Qwen2VLForConditionalGeneration.from_pretrained(tiny_gqa).eval()


@pytest.fixture(scope="module")
def engine(tiny_gqa):
    with Engine(str(tiny_gqa), limit_mm_data_per_request={"image": 1}, max_total_tokens=4096,
                show_progress=False) as eng:
        yield eng


def expected_ids(hf, prompt: str, images=None) -> list[int]:
    processor, model = hf
    return hf_greedy(model, processor, prompt, images, None, MAX_NEW)[0]


def image_span(hf, prompt: str, image) -> tuple[int, int]:
    """[start, end) of the image's placeholder run in the HF processor's ids."""
    processor, model = hf
    ids = processor(text=[prompt], images=[image], return_tensors="pt")["input_ids"][0].tolist()
    token = model.config.image_token_id
    start = ids.index(token)
    return start, start + ids.count(token)


# ---------------------------------------------------------------- formats


def test_three_input_formats_give_hf_greedy_tokens(engine, hf, scene_images):
    processor, model = hf
    image = scene_images[0]
    prompt = chat_prompt(processor, 1, QUESTION)
    enc = processor(text=[prompt], images=[image], return_tensors="pt")
    ids = enc["input_ids"][0].tolist()
    with torch.no_grad():
        feature = torch.cat(model.model.get_image_features(enc["pixel_values"], enc["image_grid_thw"]).pooler_output)
    raw = engine.generate(prompt, SP, image_data=image)
    processed = engine.generate(input_ids=ids, sampling_params=SP,
                                image_data=dict(enc, format="processor_output"))
    precomputed = engine.generate(input_ids=ids, sampling_params=SP, image_data=dict(
        format="precomputed_embedding", feature=feature, image_grid_thw=enc["image_grid_thw"]))
    want = expected_ids(hf, prompt, [image])
    for out in (raw, processed, precomputed):
        assert out["output_ids"] == want
        assert out["meta_info"]["prompt_tokens"] == len(ids)


def test_mixing_formats_in_one_request_is_refused(engine, hf, scene_images):
    processor, _ = hf
    prompt = chat_prompt(processor, 2, QUESTION)
    enc = processor(text=[chat_prompt(processor, 1, QUESTION)], images=[scene_images[0]], return_tensors="pt")
    with pytest.raises(ValueError, match="one input format per request; got a mix of processor_output, raw"):
        engine.generate(prompt, SP, image_data=[scene_images[0], dict(enc, format="processor_output")])


# ---------------------------------------------------------------- caches


def test_repeated_image_hits_prefix_preprocess_and_encoder_caches(engine, hf, scene_images):
    processor, _ = hf
    image, other = scene_images[1], scene_images[2]
    prompt = chat_prompt(processor, 1, QUESTION)
    start, end = image_span(hf, prompt, image)

    # These small images' features are under DEFER_MIN_FEATURE_BYTES, so the frontend preprocesses them
    # (eagerly) and its preprocessing cache is consulted.
    s0, f0 = engine.get_stats(), engine.get_frontend_stats()
    first = engine.generate(prompt, SP, image_data=image)
    s1, f1 = engine.get_stats(), engine.get_frontend_stats()
    assert s1.encoder_cache_misses == s0.encoder_cache_misses + 1
    assert s1.mm_eager_items == s0.mm_eager_items + 1 and s1.mm_deferred_items == s0.mm_deferred_items
    assert (f1.preprocess_cache_misses, f1.preprocess_cache_hits) == (f0.preprocess_cache_misses + 1,
                                                                      f0.preprocess_cache_hits)

    # Same image, same text: all of the prompt but its last token comes from the prefix cache,
    # so the image is neither preprocessed nor encoded again.
    second = engine.generate(prompt, SP, image_data=image)
    s2 = engine.get_stats()
    prompt_len = second["meta_info"]["prompt_tokens"]
    assert second["meta_info"]["cached_tokens"] == prompt_len - 1 >= end
    assert second["output_ids"] == first["output_ids"]
    assert s2.mm_eager_items == s1.mm_eager_items + 1
    assert engine.get_frontend_stats().preprocess_cache_hits == f1.preprocess_cache_hits + 1
    assert (s2.encoder_cache_hits, s2.encoder_cache_misses) == (s1.encoder_cache_hits, s1.encoder_cache_misses)
    assert s2.num_prefill_tokens_computed == s1.num_prefill_tokens_computed + 1

    # Same image after a different system prompt: the KV must be recomputed, the embedding
    # comes from the encoder cache, and the tokens are still HF's.
    shifted = chat_prompt(processor, 1, QUESTION, system="Answer in one word.")
    third = engine.generate(shifted, SP, image_data=image)
    s3 = engine.get_stats()
    assert s3.encoder_cache_hits == s2.encoder_cache_hits + 1
    assert s3.encoder_cache_misses == s2.encoder_cache_misses
    assert third["output_ids"] == expected_ids(hf, shifted, [image])

    # A different image after the same text: only the text before the image is shared.
    fourth = engine.generate(prompt, SP, image_data=other)
    s4, f4 = engine.get_stats(), engine.get_frontend_stats()
    assert fourth["meta_info"]["cached_tokens"] == start
    assert s4.encoder_cache_misses == s3.encoder_cache_misses + 1
    assert f4.preprocess_cache_misses == f0.preprocess_cache_misses + 2
    assert fourth["output_ids"] == expected_ids(hf, prompt, [other])
    assert fourth["output_ids"] != first["output_ids"]  # the tokens do depend on the image


def test_without_caches_a_repeat_is_recomputed(tiny_gqa, hf, scene_images):
    processor, _ = hf
    image = scene_images[1]
    prompt = chat_prompt(processor, 1, QUESTION)
    want = expected_ids(hf, prompt, [image])
    # Eager preprocessing, so the frontend's preprocessing cache (here disabled) is consulted.
    with Engine(str(tiny_gqa), mm_cache_size_mb=0, disable_radix_cache=True, max_total_tokens=4096,
                disable_deferred_mm_preprocessing=True, show_progress=False) as eng:
        for i in range(2):
            s0, f0 = eng.get_stats(), eng.get_frontend_stats()
            out = eng.generate(prompt, SP, image_data=image)
            s1, f1 = eng.get_stats(), eng.get_frontend_stats()
            assert out["output_ids"] == want
            assert out["meta_info"]["cached_tokens"] == 0
            assert s1.num_prefill_tokens_computed - s0.num_prefill_tokens_computed == out["meta_info"]["prompt_tokens"]
            assert (s1.encoder_cache_misses - s0.encoder_cache_misses, s1.encoder_cache_hits) == (1, 0)
            assert (f1.preprocess_cache_misses - f0.preprocess_cache_misses, f1.preprocess_cache_hits) == (1, 0)
            assert f1.preprocess_cache_entries == 0 and s1.encoder_cache_bytes == 0
            assert (s1.mm_eager_items - s0.mm_eager_items, s1.mm_deferred_items) == (1, 0)


# ---------------------------------------------------------------- refusals


def test_bad_media_is_refused_and_good_requests_complete(engine, hf, scene_images, scene_video):
    processor, _ = hf
    one, two = chat_prompt(processor, 1, QUESTION), chat_prompt(processor, 2, QUESTION)
    video_prompt = chat_prompt(processor, 0, "Describe the video.", num_videos=1)
    good_image = scene_images[3]
    bad = [
        (dict(prompt=one, image_data=b"definitely not an image"), "not a recognised image"),
        (dict(prompt=one, image_data="data:image/png;base64,@@not base64@@"), "invalid base64 image data"),
        (dict(prompt=two, image_data=[good_image, good_image]), "too many image items: 2 given, at most 1"),
        (dict(prompt=one, image_data=12345), "unsupported image source type int"),
        (dict(prompt="Listen.", audio_data=[b"RIFF0000WAVE"]), "takes image and video (and text), not audios"),
        (dict(prompt=video_prompt, video_data=encode_mp4(scene_video)[:-300]), "truncated"),
    ]
    want = expected_ids(hf, one, [good_image])

    async def submit_all():
        calls = [engine.async_generate(sampling_params=SP, **kwargs) for kwargs, _ in bad]
        calls.insert(3, engine.async_generate(one, SP, image_data=good_image))
        return await asyncio.gather(*calls, return_exceptions=True)

    results = asyncio.run(submit_all())
    good = results.pop(3)
    assert not isinstance(good, BaseException), good
    assert good["output_ids"] == want
    for (_, message), result in zip(bad, results):
        assert isinstance(result, ValueError), result
        assert message in str(result)
    png = encode_png(good_image)
    with pytest.raises(ValueError, match="corrupt or truncated image data"):  # the sync path raises too
        engine.generate(one, SP, image_data=png[: len(png) // 2])
    stats = engine.get_stats()
    assert (stats.kv_used_tokens, stats.num_running, stats.num_waiting) == (0, 0, 0)


def test_tensors_the_model_cannot_take_are_refused_before_the_scheduler(engine, hf, scene_images):
    """A wrong hidden size would otherwise fail inside the scheduler's forward step."""
    processor, model = hf
    prompt = chat_prompt(processor, 1, QUESTION)
    enc = processor(text=[prompt], images=[scene_images[0]], return_tensors="pt")
    rows = int(enc["image_grid_thw"].prod(-1).sum()) // 4
    hidden = model.config.get_text_config().hidden_size
    with pytest.raises(ValueError, match=f"language model takes floating-point rows of {hidden} values"):
        engine.generate(prompt, SP, image_data=dict(format="precomputed_embedding", feature=torch.zeros(rows, 7),
                                                    image_grid_thw=enc["image_grid_thw"]))
    assert engine.generate(prompt, SP, image_data=scene_images[0])["output_ids"] == expected_ids(
        hf, prompt, [scene_images[0]])


def test_language_model_only_refuses_media_and_serves_text(tiny_gqa, hf, scene_images):
    processor, _ = hf
    text_prompt = chat_prompt(processor, 0, "Hello there, how are you?")
    with Engine(str(tiny_gqa), language_model_only=True, max_total_tokens=4096, show_progress=False) as eng:
        with pytest.raises(ValueError, match="runs with --language-model-only and takes text only, not images"):
            eng.generate(chat_prompt(processor, 1, QUESTION), SP, image_data=scene_images[0])
        out = eng.generate(text_prompt, SP)
        assert out["output_ids"] == expected_ids(hf, text_prompt)
        assert eng.get_stats().kv_used_tokens == 0
