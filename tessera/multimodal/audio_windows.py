"""Cutting long audio into windows an audio encoder can take, at quiet points.

An encoder such as Whisper's takes a fixed span (30 s); longer audio must be transcribed window by window.
Each cut is placed where the short-time energy is lowest within the last `search_s` seconds before the
window's limit, so that a cut rarely falls inside a word. Adjacent windows share `overlap_s` seconds of
audio centred on the cut, so that a sound right at the cut is heard whole by at least one window.

Contract: the segments ([seg_start, seg_end), what each window reports) tile the clip exactly, in order;
every window covers its segment and is at most `max_window_s` long; a clip that fits is one window.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["AudioWindow", "split_audio"]


@dataclass(frozen=True)
class AudioWindow:
    """One window of a clip, in samples: [start, end) goes to the model, [seg_start, seg_end) is reported."""

    start: int
    end: int
    seg_start: int
    seg_end: int

    def seconds(self, rate: int) -> tuple[float, float]:
        """The reported segment in seconds."""
        return self.seg_start / rate, self.seg_end / rate


def _quietest_point(x: np.ndarray, lo: int, hi: int, frame: int) -> int:
    """The centre of the lowest-energy frame (length `frame`, hop frame // 2) in x[lo:hi]; the latest of
    equally quiet frames, so that windows stay as long as allowed."""
    hop = max(1, frame // 2)
    starts = np.arange(lo, max(lo + 1, hi - frame + 1), hop)
    if len(starts) == 0:
        return hi
    squares = np.square(x[lo:hi].astype(np.float64))
    cumsum = np.concatenate([[0.0], np.cumsum(squares)])
    ends = np.minimum(starts + frame, hi)
    energy = (cumsum[ends - lo] - cumsum[starts - lo]) / np.maximum(ends - starts, 1)
    best = len(energy) - 1 - int(np.argmin(energy[::-1]))
    return int(min(hi, starts[best] + frame // 2))


def split_audio(x: np.ndarray, rate: int, max_window_s: float, *, search_s: float = 2.0, overlap_s: float = 0.2,
                frame_s: float = 0.025) -> list[AudioWindow]:
    """Windows of the mono clip `x` (samples at `rate`) no longer than `max_window_s` seconds each.

    search_s: how far before a window's limit the quietest point is looked for; overlap_s: audio shared by
    adjacent windows around each cut; frame_s: the short-time energy frame.
    """
    if rate <= 0 or max_window_s <= 0:
        raise ValueError(f"split_audio: rate ({rate}) and max_window_s ({max_window_s}) must be positive")
    n = len(x)
    limit = int(max_window_s * rate)
    if n <= limit:
        return [AudioWindow(0, n, 0, n)]
    half = int(overlap_s * rate) // 2
    # Each step advances the segment by at most `step` samples, so that a window (its segment plus
    # `half` on each side) fits `limit`; the search stays in the second half of the step.
    step = limit - 2 * half
    if step <= 0:
        raise ValueError(f"split_audio: overlap_s ({overlap_s}) leaves no room in a {max_window_s} s window")
    search = min(int(search_s * rate), step // 2)
    frame = max(1, int(frame_s * rate))
    windows: list[AudioWindow] = []
    seg_start = 0
    while n - max(0, seg_start - half) > limit:
        end_limit = seg_start + step if seg_start else limit - half  # the first window has no left overlap
        cut = _quietest_point(x, end_limit - search, end_limit, frame)
        windows.append(AudioWindow(max(0, seg_start - half), min(n, cut + half), seg_start, cut))
        seg_start = cut
    windows.append(AudioWindow(max(0, seg_start - half), n, seg_start, n))
    return windows
