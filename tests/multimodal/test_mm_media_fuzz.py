"""Property tests: whatever bytes or strings arrive, loaders raise MediaError or succeed."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import soundfile as sf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera.multimodal.media import MediaError, MediaLimits, load_audio, load_image, load_video

from .conftest import encode_mp4, encode_png, scene_frames, scene_image, tone

FUZZ = settings(max_examples=120, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def limits(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-root")
    (root / "a.png").write_bytes(encode_png(scene_image(1, (32, 32))))
    # Small caps keep every example fast; local paths resolve against a real allowed root.
    return MediaLimits(allowed_local_media_path=str(root), max_image_pixels=1 << 20, max_video_frames=16,
                       max_video_source_frames=4096, max_audio_seconds=30.0)


def _valid_samples() -> dict[str, bytes]:
    wav = io.BytesIO()
    sf.write(wav, tone(0.25, 8000), 8000, format="WAV")
    jpeg = io.BytesIO()
    scene_image(2, (40, 30)).save(jpeg, format="JPEG")
    return {
        "png": encode_png(scene_image(3, (40, 30))),
        "jpeg": jpeg.getvalue(),
        "mp4": encode_mp4([f.resize((32, 32)) for f in scene_frames(5)][:4]),
        "wav": wav.getvalue(),
    }


SAMPLES = _valid_samples()


def _call(loader, src, limits) -> None:
    try:
        if loader is load_audio:
            loader(src, limits=limits, sampling_rate=16000)
        else:
            loader(src, limits=limits)
    except MediaError as e:
        assert str(e) and e.status in (400, 422)


LOADERS = [load_image, load_video, load_audio]
# Anything with "://" could start a real network fetch; URL behaviour is tested with a local server.
TEXT = st.text(max_size=200).filter(lambda s: "://" not in s)


@FUZZ
@given(st.sampled_from(LOADERS), st.binary(max_size=2048))
def test_random_bytes(limits, loader, data):
    _call(loader, data, limits)


@FUZZ
@given(st.sampled_from(LOADERS), st.one_of(
    TEXT,
    st.binary(max_size=512).map(lambda b: base64.b64encode(b).decode()),
    st.binary(max_size=512).map(lambda b: "data:application/octet-stream;base64," + base64.b64encode(b).decode()),
    st.text(max_size=100).map(lambda s: "data:" + s),
    st.text(max_size=60).map(lambda s: "file://" + s),
    st.sampled_from(["a.png", "../a.png", "./a.png", "/", ".", "~", "\0", "a.png\0x"]),
))
def test_random_strings(limits, loader, src):
    _call(loader, src, limits)


@FUZZ
@given(st.sampled_from(LOADERS), st.sampled_from(sorted(SAMPLES)), st.data())
def test_mutated_valid_media(limits, loader, kind, data):
    blob = bytearray(SAMPLES[kind])
    for _ in range(data.draw(st.integers(0, 8))):
        pos = data.draw(st.integers(0, len(blob) - 1))
        blob[pos] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(blob)))
    _call(loader, bytes(blob[:cut] if data.draw(st.booleans()) else blob), limits)


@FUZZ
@given(st.one_of(
    st.integers(), st.floats(), st.none(), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
    st.builds(lambda s: np.zeros(s, np.uint8), st.lists(st.integers(0, 5), max_size=5)),
    st.builds(lambda s: np.zeros(s, np.float32), st.lists(st.integers(0, 5), max_size=3)),
))
def test_arbitrary_objects(limits, src):
    for loader in LOADERS:
        _call(loader, src, limits)
