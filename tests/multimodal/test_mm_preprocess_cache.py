"""The preprocessing cache: a repeated item skips the HF processor, and the output (ids,
offsets, hashes, features, M-RoPE positions) is identical to processing it from scratch."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from tessera.messages.items import Modality
from tessera.multimodal.processors.assemble import ItemFeatures
from tessera.multimodal.processors.base import ProcessorOutput
from tessera.multimodal.processors.preprocess_cache import PreprocessCache

from .conftest import encode_png, scene_frames, scene_image
from .test_mm_qwen_processor import chat_prompt

MB = 1024 * 1024


def assert_same_output(a: ProcessorOutput, b: ProcessorOutput) -> None:
    assert a.input_ids == b.input_ids
    assert [(i.modality, i.hash, i.offsets) for i in a.mm_inputs.items] == \
        [(i.modality, i.hash, i.offsets) for i in b.mm_inputs.items]
    for x, y in zip(a.mm_inputs.items, b.mm_inputs.items):
        assert torch.equal(x.feature, y.feature)
        assert x.model_specific_data.keys() == y.model_specific_data.keys()
        assert all(torch.equal(x.model_specific_data[k], y.model_specific_data[k]) for k in x.model_specific_data)
    assert torch.equal(a.mm_inputs.mrope_positions, b.mm_inputs.mrope_positions)
    assert a.mm_inputs.mrope_position_delta == b.mm_inputs.mrope_position_delta


class HFCalls:
    """Records every HF processor call: (text given?, number of images, number of videos)."""

    def __init__(self, proc: Any) -> None:
        self.calls: list[tuple[bool, int, int]] = []
        self._lock = threading.Lock()
        inner = proc.call_hf_processor

        def call(prompt: str | None, loaded: Any) -> Any:
            with self._lock:
                self.calls.append((prompt is not None, len(loaded.images), len(loaded.videos)))
            return inner(prompt, loaded)

        proc.call_hf_processor = call


@pytest.fixture(scope="module")
def media():
    images = [scene_image(20 + i, size) for i, size in enumerate([(300, 200), (90, 400), (128, 128)])]
    video = [f.resize((120, 90)) for f in scene_frames(5)]
    return images, video


def test_repeat_skips_hf_and_matches_reference(skeleton, make_processor, media):
    images, video = media
    prompt = chat_prompt(skeleton, ["image", "video", "image", "Describe."])
    reference = make_processor().process(prompt=prompt, image_data=images[:2], video_data=[video])
    proc = make_processor(cache_size_bytes=64 * MB)
    hf = HFCalls(proc)
    first = proc.process(prompt=prompt, image_data=images[:2], video_data=[video])
    assert hf.calls == [(True, 2, 1)]  # all missed: one call with the prompt (the reference path)
    assert (proc.preprocess_cache_hits, proc.preprocess_cache_misses) == (0, 3)
    again = proc.process(prompt=prompt, image_data=[encode_png(images[0]), images[1]], video_data=[video])
    assert hf.calls == [(True, 2, 1)]  # every item hit: no HF call at all
    assert (proc.preprocess_cache_hits, proc.preprocess_cache_misses) == (3, 3)
    for out in (first, again):
        assert_same_output(out, reference)


def test_partial_hit_processes_only_the_new_items(skeleton, make_processor, media):
    images, video = media
    proc = make_processor(cache_size_bytes=64 * MB)
    hf = HFCalls(proc)
    proc.process(prompt=chat_prompt(skeleton, ["image", "x"]), image_data=[images[1]])
    prompt = chat_prompt(skeleton, ["image", "video", "image", "image", "Describe."])
    data = dict(image_data=[images[0], images[1], images[2]], video_data=[video])
    out = proc.process(prompt=prompt, **data)
    # images[1] came from the cache; the others went through HF together, without the prompt.
    assert hf.calls == [(True, 1, 0), (False, 2, 1)]
    assert (proc.preprocess_cache_hits, proc.preprocess_cache_misses) == (1, 4)
    assert_same_output(out, make_processor().process(prompt=prompt, **data))
    from_ids = proc.process(input_ids=proc.tokenize(prompt), **data)
    assert hf.calls[2:] == []
    assert_same_output(from_ids, out)


def test_disabled_cache_preprocesses_every_time(skeleton, make_processor, media):
    images, _ = media
    proc = make_processor(cache_size_bytes=0)
    hf = HFCalls(proc)
    prompt = chat_prompt(skeleton, ["image", "x"])
    outs = [proc.process(prompt=prompt, image_data=[images[0]]) for _ in range(2)]
    assert hf.calls == [(True, 1, 0)] * 2
    assert (proc.preprocess_cache_hits, proc.preprocess_cache_misses) == (0, 2)
    assert len(proc.preprocess_cache) == 0
    assert_same_output(outs[0], outs[1])


def test_feature_kwargs_are_part_of_the_key(skeleton, make_processor, media):
    images, _ = media
    prompt = chat_prompt(skeleton, ["image", "x"])
    small = make_processor(cache_size_bytes=64 * MB, mm_process_config={"image": {"max_pixels": 28 * 28 * 8}})
    plain = make_processor(cache_size_bytes=64 * MB)
    a, b = small.process(prompt=prompt, image_data=[images[0]]), plain.process(prompt=prompt, image_data=[images[0]])
    # Share one cache between the two configurations: the other's entry must not be reused.
    plain.preprocess_cache = small.preprocess_cache
    c = plain.process(prompt=prompt, image_data=[images[0]])
    assert small.preprocess_cache.misses == 2 and small.preprocess_cache.hits == 0
    assert_same_output(c, b)
    assert len(a.input_ids) < len(b.input_ids)


def _features(num_bytes: int) -> ItemFeatures:
    n = num_bytes // 4 - 3 * 2  # float32 rows plus a [1, 3] int64 grid
    return ItemFeatures(modality=Modality.IMAGE, num_tokens=1, feature=torch.zeros(n, dtype=torch.float32),
                        model_specific_data={"image_grid_thw": torch.tensor([[1, 2, 2]])})


def test_lru_is_bounded_in_bytes():
    cache = PreprocessCache(capacity_bytes=1000)
    cache.put(1, _features(400))
    cache.put(2, _features(400))
    assert cache.used_bytes == 800 and len(cache) == 2
    assert cache.get(1) is not None  # 1 is now the most recent
    cache.put(3, _features(400))  # evicts 2, the least recently used
    assert 2 not in cache and 1 in cache and 3 in cache and cache.used_bytes == 800
    cache.put(4, _features(1200))  # larger than the budget: never stored, nothing evicted
    assert 4 not in cache and len(cache) == 2
    assert (cache.hits, cache.misses) == (1, 0)
    assert cache.get(2) is None and cache.misses == 1
    cache.clear()
    assert len(cache) == 0 and cache.used_bytes == 0
    with pytest.raises(ValueError, match="capacity must be >= 0"):
        PreprocessCache(-1)


def test_entries_survive_callers_editing_their_copy():
    cache = PreprocessCache(capacity_bytes=10_000)
    feats = _features(400)
    cache.put(7, feats)
    feats.model_specific_data["extra"] = torch.ones(1)
    got = cache.get(7)
    assert got is not None and set(got.model_specific_data) == {"image_grid_thw"}
    got.model_specific_data.clear()
    again = cache.get(7)
    assert again is not None and set(again.model_specific_data) == {"image_grid_thw"}
    assert again.feature is feats.feature  # shared, not copied


def test_concurrent_requests_match_sequential(skeleton, make_processor, media):
    images, video = media
    one, two = chat_prompt(skeleton, ["image", "?"]), chat_prompt(skeleton, ["image", "video", "image", "?"])
    jobs = [(one, [images[i % 3]], None) if i % 2 else (two, [images[i % 3], images[(i + 1) % 3]], [video])
            for i in range(24)]
    reference = make_processor()
    expected = [reference.process(prompt=p, image_data=im, video_data=v) for p, im, v in jobs]
    proc = make_processor(cache_size_bytes=64 * MB, io_workers=2)
    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda job: proc.process(prompt=job[0], image_data=job[1], video_data=job[2]), jobs))
    for out, ref in zip(outs, expected):
        assert_same_output(out, ref)
    num_items = sum(len(im) + len(v or []) for _, im, v in jobs)
    assert proc.preprocess_cache_hits + proc.preprocess_cache_misses == num_items
    assert len(proc.preprocess_cache) == 4  # three images and one video
    assert proc.preprocess_cache_misses < num_items // 2
