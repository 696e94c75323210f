"""Video and audio loading: sampling, metadata, resampling, and refusal of bad input."""

from __future__ import annotations

import base64
import io

import av
import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from tessera.multimodal.media import MediaError, MediaLimits, load_audio, load_video, sample_frame_indices

from .conftest import decode_all_frames, encode_mp4, scene_frames, tone

OFFLINE = MediaLimits.offline()


@pytest.fixture(scope="module")
def mp4() -> tuple[bytes, list[Image.Image]]:
    frames = [f.resize((96, 64)) for f in scene_frames(7)] * 2  # 8..32 frames
    data = encode_mp4(frames, fps=10)
    return data, decode_all_frames(data)


def _same(a: Image.Image, b: Image.Image) -> bool:
    return a.size == b.size and np.array_equal(np.asarray(a), np.asarray(b))


def test_video_decodes_all_frames_with_metadata(mp4):
    data, reference = mp4
    clip = load_video(data, limits=OFFLINE)
    assert clip.fps == 10.0 and clip.total_num_frames == len(reference)
    assert clip.sampled_indices == list(range(len(reference)))
    assert all(_same(a, b) for a, b in zip(clip.frames, reference))


@pytest.mark.parametrize(("kwargs", "expected_n"), [
    ({"num_frames": 5}, 5), ({"fps": 2.0}, None), ({"max_frames": 3}, 3), ({"fps": 100.0, "max_frames": 4}, 4),
])
def test_video_sampling(mp4, kwargs, expected_n):
    data, reference = mp4
    clip = load_video(data, limits=OFFLINE, **kwargs)
    total = len(reference)
    n = expected_n if expected_n is not None else round(total * 2.0 / 10.0)
    assert len(clip.frames) == n
    assert clip.sampled_indices[0] == 0 and clip.sampled_indices[-1] == total - 1
    assert clip.sampled_indices == sorted(set(clip.sampled_indices))
    assert all(_same(f, reference[i]) for f, i in zip(clip.frames, clip.sampled_indices))
    assert clip.sampled_fps == pytest.approx(10.0 * n / total)


def test_sample_frame_indices_edges():
    assert sample_frame_indices(10, source_fps=None, fps=2.0) == list(range(10))  # fps unknown: all
    assert sample_frame_indices(10, source_fps=5.0, num_frames=50) == list(range(10))
    assert sample_frame_indices(10, source_fps=5.0, num_frames=1) == [0]
    assert sample_frame_indices(100, source_fps=5.0, limit=4) == [0, 33, 66, 99]
    assert sample_frame_indices(0, source_fps=5.0) == []


def test_video_sources_and_frame_lists(mp4, tmp_path):
    data, reference = mp4
    path = tmp_path / "v.mp4"
    path.write_bytes(data)
    b64 = base64.b64encode(data).decode()
    for src in (str(path), b64, "data:video/mp4;base64," + b64):
        assert len(load_video(src, limits=OFFLINE, num_frames=3).frames) == 3
    frames = [np.asarray(f) for f in reference[:4]]
    clip = load_video(frames, limits=OFFLINE, num_frames=2)  # lists are kept as they are
    assert len(clip.frames) == 4 and clip.fps is None and clip.sampled_indices == [0, 1, 2, 3]
    assert len(load_video(np.stack(frames), limits=OFFLINE).frames) == 4
    sampled = load_video(data, limits=OFFLINE, num_frames=3)
    again = load_video(sampled, limits=OFFLINE)  # a loaded clip passes through with its metadata
    assert again.sampled_indices == sampled.sampled_indices and again.fps == 10.0


@pytest.mark.parametrize(("make_src", "limits", "message"), [
    (lambda d: d[: len(d) - 200], OFFLINE, "truncated"),
    (lambda d: d[: len(d) // 2], OFFLINE, "truncated"),
    (lambda d: b"\0" * 1000, OFFLINE, "corrupt, truncated or unsupported video"),
    (lambda d: "###", OFFLINE, "local media files|does not exist"),
    (lambda d: 3.5, OFFLINE, "unsupported video source type float"),
    (lambda d: [], OFFLINE, "empty"),
    (lambda d: [Image.new("RGB", (8, 8))] * 5, MediaLimits(max_video_frames=4), "5 frames, over the limit of 4"),
    (lambda d: [Image.new("RGB", (8, 8)), Image.new("RGB", (9, 8))], OFFLINE, "different sizes"),
    (lambda d: [Image.new("RGB", (8, 8)), "frame"], OFFLINE, "frame 1 has unsupported type str"),
    (lambda d: d, MediaLimits(max_video_bytes=100), "over the limit of 100 bytes"),
    (lambda d: d, MediaLimits(max_video_total_pixels=96 * 64 * 2), "total pixels"),
    (lambda d: d, MediaLimits(max_video_source_frames=3), "over the limit of 3"),
    (lambda d: d, MediaLimits(max_image_pixels=100), "over the limit of 100"),
    (lambda d: np.zeros((4, 4, 3), np.uint8), OFFLINE, "TxHxWxC"),
])
def test_bad_videos_raise_media_error(mp4, make_src, limits, message):
    with pytest.raises(MediaError, match=message):
        load_video(make_src(mp4[0]), limits=limits)


def test_bad_sampling_parameter_is_a_value_error(mp4):
    with pytest.raises(ValueError, match="num_frames must be positive"):
        load_video(mp4[0], limits=OFFLINE, num_frames=0)


# ---------------------------------------------------------------- audio


def _wav(x: np.ndarray, rate: int, fmt: str = "WAV") -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format=fmt)
    return buf.getvalue()


def _m4a(x: np.ndarray, rate: int) -> bytes:
    """AAC in mp4: libsndfile cannot read it, so this exercises the PyAV path."""
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=rate, layout="mono")
        frame = av.AudioFrame.from_ndarray(x[None, :].astype(np.float32), format="flt", layout="mono")
        frame.sample_rate = rate
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buf.getvalue()


def _dominant_hz(x: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(x))
    return float(np.fft.rfftfreq(len(x), 1 / rate)[int(np.argmax(spectrum))])


@pytest.mark.parametrize("encode", ["wav_stereo", "flac", "ogg", "mp3", "m4a"])
def test_audio_decodes_resamples_and_mixes_down(encode):
    rate = 44100
    mono = tone(1.0, rate)
    data = {
        "wav_stereo": lambda: _wav(np.stack([mono, mono], axis=1), rate),
        "flac": lambda: _wav(mono, rate, "FLAC"),
        "ogg": lambda: _wav(mono, rate, "OGG"),
        "mp3": lambda: _wav(mono, rate, "MP3"),
        "m4a": lambda: _m4a(mono, rate),
    }[encode]()
    x = load_audio(data, limits=OFFLINE, sampling_rate=16000)
    assert x.dtype == np.float32 and x.ndim == 1
    assert abs(len(x) - 16000) <= 2048  # codec priming/padding for lossy formats
    assert _dominant_hz(x, 16000) == pytest.approx(440.0, abs=3.0)
    assert 0.3 < np.abs(x[4000:12000]).max() < 0.7  # the middle: lossy codecs overshoot at the cut-off end


def test_audio_arrays_and_tuples():
    x = tone(0.5, 8000)
    assert np.array_equal(load_audio(x, limits=OFFLINE, sampling_rate=8000), x)
    y = load_audio((np.stack([x, -x], axis=1), 8000), limits=OFFLINE, sampling_rate=16000)
    assert abs(len(y) - 8000) <= 64 and np.abs(y).max() < 1e-6  # (x + -x) / 2 == 0


@pytest.mark.parametrize(("src", "limits", "message"), [
    (b"RIFF\x00\x00\x00\x00WAVEjunk", OFFLINE, "corrupt|unsupported audio"),
    (b"\x00" * 512, OFFLINE, "corrupt|unsupported audio|no decodable"),
    (_wav(tone(3.0, 8000), 8000), MediaLimits(max_audio_seconds=2.0), "over the limit of 2 s"),
    (_m4a(tone(3.0, 8000), 8000), MediaLimits(max_audio_seconds=2.0), "over the limit of 2 s"),
    (np.zeros(10, np.int16), OFFLINE, "floating point"),
    (np.array([0.0, np.nan], np.float32), OFFLINE, "non-finite"),
    (object(), OFFLINE, "unsupported audio source type"),
])
def test_bad_audio_raises_media_error(src, limits, message):
    with pytest.raises(MediaError, match=message):
        load_audio(src, limits=limits, sampling_rate=16000)


def test_an_image_sent_as_audio_or_video_is_named() -> None:
    """FFmpeg's own word for a PNG given as audio is "Invalid argument ... returned 22"."""
    import io as _io

    from PIL import Image

    png = _io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    with pytest.raises(MediaError, match="data is a PNG image, not audio"):
        load_audio(png.getvalue(), limits=OFFLINE, sampling_rate=16000)
    with pytest.raises(MediaError, match="unsupported audio data: not readable as any of mp3, aac"):
        load_audio(b"not audio at all" * 20, limits=OFFLINE, sampling_rate=16000)
