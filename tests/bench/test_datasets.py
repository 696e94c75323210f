"""Benchmark inputs are deterministic, well-formed, and refuse bad arguments by name."""

from __future__ import annotations

import base64
import io
import statistics

import pytest
from PIL import Image

from tessera.bench.datasets import (BenchRequest, Resolution, make_serving_dataset, offline_workload,
                                    poisson_intervals)


def test_same_seed_same_bytes_other_seed_other_bytes() -> None:
    kw = dict(image_resolution="random:32-64", image_count=2, output_len=9, input_len=5)
    a = make_serving_dataset("random-image", 3, seed=1, **kw)
    b = make_serving_dataset("random-image", 3, seed=1, **kw)
    c = make_serving_dataset("random-image", 3, seed=2, **kw)
    assert a == b
    assert [r.images for r in a] != [r.images for r in c]
    assert all(len(r.images) == 2 and r.output_len == 9 and len(r.text.split()) == 5 for r in a)


def test_random_image_sizes_follow_the_resolution_spec() -> None:
    reqs = make_serving_dataset("random-image", 6, seed=0, image_resolution="random:40-60")
    sizes = [Image.open(io.BytesIO(r.images[0])).size for r in reqs]
    assert all(40 <= w <= 60 and 40 <= h <= 60 for w, h in sizes)
    assert len(set(sizes)) > 1  # actually random, not one size
    fixed = make_serving_dataset("random-image", 2, seed=0, image_resolution="48x32")
    assert {Image.open(io.BytesIO(r.images[0])).size for r in fixed} == {(48, 32)}


def test_scenes_dataset_has_demo_questions_and_png_images() -> None:
    reqs = make_serving_dataset("scenes", 4, seed=3)
    assert all(r.image_mime == "image/png" and r.text.endswith(("?", ".")) for r in reqs)
    assert all(128 <= Image.open(io.BytesIO(r.images[0])).size[0] <= 512 for r in reqs)


def test_random_video_is_a_decodable_mp4_with_the_requested_frames() -> None:
    import av

    (req,) = make_serving_dataset("random-video", 1, seed=0, image_resolution="48x32", video_frames=4)
    assert req.images == () and len(req.videos) == 1
    with av.open(io.BytesIO(req.videos[0])) as container:
        frames = list(container.decode(video=0))
    assert len(frames) == 4 and (frames[0].width, frames[0].height) == (48, 32)


def test_openai_messages_carry_the_exact_bytes_as_data_uris() -> None:
    req = BenchRequest("hi", (b"\x89PNGfake",), "image/png", (b"vid",), 3)
    (msg,) = req.openai_messages()
    img, vid, text = msg["content"]
    assert img["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(b"\x89PNGfake").decode()
    assert vid["video_url"]["url"].startswith("data:video/mp4;base64,")
    assert text == {"type": "text", "text": "hi"}


@pytest.mark.parametrize("spec", ["448", "0x10", "random:9-3", "random:a-b", "big"])
def test_bad_resolution_names_the_field(spec: str) -> None:
    with pytest.raises(ValueError, match="image_resolution"):
        Resolution.parse(spec)


def test_random_audio_is_wav_in_input_audio_parts() -> None:
    import base64
    import io

    import soundfile as sf

    reqs = make_serving_dataset("random-audio", 3, seed=5, audio_seconds=2.5, input_len=0)
    assert reqs == make_serving_dataset("random-audio", 3, seed=5, audio_seconds=2.5, input_len=0)
    assert len({r.audios for r in reqs}) == 3  # distinct clips: no cache hits between requests
    content = reqs[0].openai_messages()[0]["content"]
    assert [c["type"] for c in content] == ["input_audio", "text"] and content[1]["text"] == "Transcribe the audio."
    x, rate = sf.read(io.BytesIO(base64.b64decode(content[0]["input_audio"]["data"])))
    assert rate == 16000 and x.ndim == 1 and len(x) == 40000 and 0.1 < abs(x).max() < 1.0
    with pytest.raises(ValueError, match="audio_seconds"):
        make_serving_dataset("random-audio", 1, audio_seconds=0)


def test_bad_serving_datasets_name_the_field() -> None:
    with pytest.raises(ValueError, match="dataset"):
        make_serving_dataset("nope", 1)
    with pytest.raises(ValueError, match="num_prompts"):
        make_serving_dataset("scenes", 0)


def test_poisson_intervals() -> None:
    assert poisson_intervals(5, float("inf"), 0) == [0.0] * 5
    gaps = poisson_intervals(4000, 10.0, 0)
    assert gaps == poisson_intervals(4000, 10.0, 0)
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.06)  # mean gap of a Poisson process is 1/rate
    assert statistics.stdev(gaps) == pytest.approx(0.1, rel=0.1)  # exponential: stdev == mean
    with pytest.raises(ValueError, match="request_rate"):
        poisson_intervals(3, 0.0, 0)


def test_offline_workloads_are_deterministic_and_shaped_as_described() -> None:
    a = offline_workload("a", seed=0, num_requests=20)
    assert [r.question for r in a] == [r.question for r in offline_workload("a", seed=0, num_requests=20)]
    assert all(16 <= r.output_len <= 128 and len(r.images) == 1 for r in a)
    assert len({r.images[0].size for r in a}) > 1  # mixed sizes
    b = offline_workload("b", seed=0, num_requests=20, num_distinct_images=4)
    for i, r in enumerate(b):
        assert r.images[0] is b[i % 4].images[0]  # round-robin over the same 4 images
    assert len({id(r.images[0]) for r in b}) == 4
    assert len({r.question for r in b}) > 1
    c = offline_workload("c", seed=0, num_requests=3, system_prompt="SYS", max_output_len=5)
    assert all(r.system == "SYS" and r.output_len == 5 for r in c)
    with pytest.raises(ValueError, match="system_prompt"):
        offline_workload("c", num_requests=3)
