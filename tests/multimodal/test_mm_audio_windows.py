"""split_audio: windows fit the encoder, segments tile the clip, cuts land in quiet gaps."""

from __future__ import annotations

import numpy as np
import pytest

from tessera.multimodal.audio_windows import split_audio

RATE = 1000  # a low rate keeps the arrays small; the arithmetic is the same


def _bursts(seconds: float, gaps: list[tuple[float, float]], seed: int = 0) -> np.ndarray:
    """Loud noise everywhere except near-silent `gaps` ([start, end) in seconds)."""
    x = np.random.default_rng(seed).uniform(-1, 1, int(seconds * RATE)).astype(np.float32)
    for a, b in gaps:
        x[int(a * RATE): int(b * RATE)] *= 1e-3
    return x


def _check_tiling(windows, n: int, max_window_s: float) -> None:
    assert windows[0].seg_start == 0 and windows[-1].seg_end == n
    for a, b in zip(windows, windows[1:]):
        assert a.seg_end == b.seg_start
    for w in windows:
        assert w.start <= w.seg_start < w.seg_end <= w.end
        assert w.end - w.start <= int(max_window_s * RATE)


def test_short_clip_is_one_window():
    x = np.zeros(30 * RATE, np.float32)
    [w] = split_audio(x, RATE, 30.0)
    assert (w.start, w.end, w.seg_start, w.seg_end) == (0, len(x), 0, len(x))


def test_cuts_fall_in_the_quiet_gaps_near_the_window_end():
    gaps = [(28.6, 28.9), (57.2, 57.5)]
    x = _bursts(70.0, gaps)
    windows = split_audio(x, RATE, 30.0, overlap_s=0.2)
    _check_tiling(windows, len(x), 30.0)
    assert len(windows) == 3
    for w, (a, b) in zip(windows, gaps):
        assert a * RATE <= w.seg_end <= b * RATE, (w, a, b)
        assert w.end - w.seg_end == 100  # half the overlap on each side of the cut
    assert windows[1].seg_start - windows[1].start == 100


@pytest.mark.parametrize("seconds", [30.001, 61.0, 95.5, 301.0])
def test_without_quiet_points_windows_still_tile_and_fit(seconds):
    x = _bursts(seconds, [], seed=int(seconds))
    windows = split_audio(x, RATE, 30.0)
    _check_tiling(windows, len(x), 30.0)
    assert len(windows) <= int(seconds // 28) + 2  # each cut is within search_s of the limit


def test_silence_keeps_windows_as_long_as_allowed():
    windows = split_audio(np.zeros(65 * RATE, np.float32), RATE, 30.0, overlap_s=0.2)
    _check_tiling(windows, 65 * RATE, 30.0)
    frame = int(0.025 * RATE)  # the cut is a frame centre, so within one frame of the limit
    assert all(30 * RATE - frame <= w.end - w.start <= 30 * RATE for w in windows[:2])


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="must be positive"):
        split_audio(np.zeros(10, np.float32), 0, 30.0)
    with pytest.raises(ValueError, match="leaves no room"):
        split_audio(np.zeros(10 * RATE, np.float32), RATE, 1.0, overlap_s=2.0)
