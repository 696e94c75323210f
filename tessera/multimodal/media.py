"""Loaders for untrusted images, videos and audio.

Contract: `load_image`, `load_video` and `load_audio` either return decoded media within
`MediaLimits` or raise `MediaError` (a ValueError whose message names the problem and whose
`status` is 400, or 422 for an unreachable URL). No other exception type escapes for bad
input: decoder failures of any kind are converted, with the original chained as the cause.

PyAV (`av`) and soundfile are imported only when a video or audio is decoded, so images need
neither; a decode that needs a missing one raises MediaError with status 501 naming the package.

Decoders are restricted to an allow-list of container formats (PIL `formats=`, FFmpeg
`format_whitelist`) so that untrusted bytes cannot reach exotic demuxers (e.g. HLS playlists
that open further URLs or files).
Resampling choice: audio is resampled with FFmpeg's libswresample through PyAV (no SciPy);
channels are mixed down to mono by averaging before resampling.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from tessera.messages.items import Modality
from tessera.multimodal.media_source import MediaError, MediaLimits, read_media_bytes

__all__ = ["MediaError", "MediaLimits", "VideoClip", "load_image", "load_video", "load_audio"]

# Formats this Pillow build registers (JPEG covers MPO where available); EPS and friends stay out.
Image.init()
IMAGE_FORMATS = tuple(f for f in ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "MPO", "PPM", "AVIF") if f in Image.OPEN)
VIDEO_CONTAINERS = "mov,mp4,m4a,3gp,3g2,mj2,matroska,webm,avi,mpegts,flv,gif,ogg,mpeg"
AUDIO_CONTAINERS = "mp3,aac,mov,mp4,m4a,3gp,matroska,webm,ogg,flac,wav,w64,aiff,amr"

MediaSource = str | os.PathLike[str] | bytes | bytearray | memoryview


def _import_av(purpose: str) -> Any:
    """PyAV, imported on first use (video decoding, audio decoding and resampling)."""
    try:
        import av
    except ImportError as e:
        raise MediaError(f"{purpose} needs PyAV, which is not installed: pip install av", status=501) from e
    return av


def _import_soundfile() -> Any | None:
    """soundfile, or None when it (or its libsndfile) is missing: PyAV then decodes wav/flac/ogg too."""
    try:
        import soundfile
    except (ImportError, OSError):  # OSError: the package is there but libsndfile is not
        return None
    return soundfile


@dataclass
class VideoClip:
    """Sampled frames of one video and where they came from."""

    frames: list[Image.Image]  # RGB, in time order
    fps: float | None  # the source's frame rate; None for frames given as a list
    total_num_frames: int  # frames in the source
    sampled_indices: list[int]  # source index of each frame in `frames`

    @property
    def sampled_fps(self) -> float | None:
        """Frame rate of the sampled frames, spread over the source duration."""
        if not self.fps or self.total_num_frames == 0:
            return None
        return self.fps * len(self.frames) / self.total_num_frames


# ---------------------------------------------------------------- images


def _check_image_size(width: int, height: int, limits: MediaLimits) -> None:
    if width <= 0 or height <= 0:
        raise MediaError(f"image has an empty size {width}x{height}")
    if width * height > limits.max_image_pixels:
        raise MediaError(
            f"image is {width}x{height} = {width * height} pixels, over the limit of {limits.max_image_pixels} "
            "(the server's --max-image-pixels)"
        )


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB, compositing any transparency onto white (as transformers' convert_to_rgb does, so
    an RGBA input gives the HF processor's pixels, and transparent areas are not black)."""
    if "A" in img.getbands() or img.info.get("transparency") is not None:
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def _image_from_array(arr: np.ndarray, limits: MediaLimits) -> Image.Image:
    if arr.dtype != np.uint8:
        raise MediaError(f"image array must be uint8 (HWC), got dtype {arr.dtype}")
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    if not (arr.ndim == 2 or (arr.ndim == 3 and arr.shape[2] in (3, 4))):
        raise MediaError(f"image array must have shape HxW, HxWx1, HxWx3 or HxWx4, got {tuple(arr.shape)}")
    _check_image_size(arr.shape[1], arr.shape[0], limits)
    return to_rgb(Image.fromarray(np.ascontiguousarray(arr)))


def _decode_image_bytes(data: bytes, limits: MediaLimits) -> Image.Image:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)  # lazy: reads the header only
    except Image.UnidentifiedImageError as e:
        video = looks_like_video(data)
        hint = f" ({video}: send it as a video_url part, or as video_data)" if video else ""
        raise MediaError(f"data is not a recognised image (supported: {', '.join(IMAGE_FORMATS)}){hint}") from e
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        # PIL's own header check fired first (its MAX_IMAGE_PIXELS is a second, global cap).
        raise MediaError(f"image size is over the limit of {limits.max_image_pixels} pixels (the server's "
                         f"--max-image-pixels): {e}") from e
    except Exception as e:  # noqa: BLE001 - any header-parser failure is bad input
        raise MediaError(f"cannot read image header: {type(e).__name__}: {e}") from e
    # Pixel cap before decoding the pixel data (decompression-bomb safety).
    _check_image_size(img.width, img.height, limits)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img.seek(0)  # first frame of an animation
            img.load()
            return to_rgb(img)
    except Exception as e:  # noqa: BLE001 - truncated or corrupt pixel data
        raise MediaError(f"corrupt or truncated image data: {type(e).__name__}: {e}") from e


def _image_from_object(src: Any, limits: MediaLimits) -> Image.Image | None:
    """Decoded in-memory images (PIL, numpy, torch); None when `src` is an encoded source."""
    if isinstance(src, Image.Image):
        _check_image_size(src.width, src.height, limits)
        try:
            return to_rgb(src)
        except Exception as e:  # noqa: BLE001 - a lazily opened image may fail on load
            raise MediaError(f"cannot convert image to RGB: {type(e).__name__}: {e}") from e
    if isinstance(src, torch.Tensor):
        return _image_from_array(src.detach().cpu().numpy(), limits)
    if isinstance(src, np.ndarray):
        return _image_from_array(src, limits)
    return None


def load_image(src: Any, *, limits: MediaLimits) -> Image.Image:
    """An RGB image from a PIL image, uint8 HWC array/tensor, bytes, path, file:// or
    http(s) URL, data URI or bare base64 string. Raises MediaError for anything else."""
    img = _image_from_object(src, limits)
    if img is not None:
        return img
    if not isinstance(src, (str, os.PathLike, bytes, bytearray, memoryview)):
        raise MediaError(f"unsupported image source type {type(src).__name__}")
    return _decode_image_bytes(read_media_bytes(src, modality=Modality.IMAGE, limits=limits), limits)


# ---------------------------------------------------------------- videos


def sample_frame_indices(total: int, *, source_fps: float | None, fps: float | None = None,
                         max_frames: int | None = None, num_frames: int | None = None,
                         limit: int | None = None) -> list[int]:
    """Uniformly spaced source indices (first and last included when more than one).

    `num_frames` wins over `fps`; `fps` needs a known `source_fps`. The count is clamped to
    [1, total] and then to `max_frames` and `limit`.
    """
    if total <= 0:
        return []
    if num_frames is not None:
        n = num_frames
    elif fps is not None and source_fps:
        n = int(round(total * fps / source_fps))
    else:
        n = total
    for cap in (max_frames, limit):
        if cap is not None:
            n = min(n, cap)
    n = max(1, min(n, total))
    return [int(x) for x in np.floor(np.linspace(0, total - 1, n) + 0.5)]


def _frames_from_list(frames: list[Any] | tuple[Any, ...], limits: MediaLimits) -> VideoClip:
    if not frames:
        raise MediaError("video frame list is empty")
    if len(frames) > limits.max_video_frames:
        raise MediaError(f"video has {len(frames)} frames, over the limit of {limits.max_video_frames}")
    images = []
    for i, f in enumerate(frames):
        img = _image_from_object(f, limits)
        if img is None:
            raise MediaError(f"video frame {i} has unsupported type {type(f).__name__}")
        images.append(img)
    if len({im.size for im in images}) != 1:
        raise MediaError("video frames have different sizes")
    _check_video_pixels(len(images), *images[0].size, limits)
    return VideoClip(images, None, len(images), list(range(len(images))))


def _check_video_pixels(n: int, width: int, height: int, limits: MediaLimits) -> None:
    _check_image_size(width, height, limits)
    if n * width * height > limits.max_video_total_pixels:
        raise MediaError(
            f"video sample is {n} frames of {width}x{height}, over the limit of "
            f"{limits.max_video_total_pixels} total pixels"
        )


@contextlib.contextmanager
def _first_stream(data: bytes, kind: str, containers: str, purpose: str) -> Iterator[tuple[Any, Any, Any]]:
    """(av, container, stream): PyAV's first `kind` ("video" or "audio") stream of `data`, opened among
    `containers` only. FFmpeg errors of any kind inside the block are bad input: MediaError."""
    av = _import_av(purpose)
    image = _image_kind(data)
    if image and not (kind == "video" and image == "a GIF"):  # FFmpeg would only say "Invalid argument"
        raise MediaError(f"data is {image} image, not {kind} (send it as an image)")
    opened = False
    try:
        with av.open(io.BytesIO(data), options={"format_whitelist": containers}) as container:
            opened = True
            streams = getattr(container.streams, kind)
            if not streams:
                raise MediaError(f"media has no {kind} stream")
            yield av, container, streams[0]
    except MediaError:
        raise
    except Exception as e:  # noqa: BLE001 - FFmpeg errors of any kind are bad input
        if not opened:
            raise MediaError(f"corrupt, truncated or unsupported {kind} data: not readable as any of "
                             f"{containers.replace(',', ', ')}") from e
        raise MediaError(f"corrupt, truncated or unsupported {kind} data: {type(e).__name__}: {e}") from e


def looks_like_video(data: bytes) -> str:
    """"it looks like a video" for the containers a video usually comes in (MP4/MOV, WebM/MKV, AVI), else "":
    the hint an image that is not one gets."""
    if data[4:8] == b"ftyp" or data[:4] == b"\x1a\x45\xdf\xa3" or (data[:4] == b"RIFF" and data[8:12] == b"AVI "):
        return "it looks like a video"
    return ""


def _image_kind(data: bytes) -> str:
    """"a PNG" (etc.) when the bytes start like an image file, else ""."""
    for magic, name in ((b"\x89PNG", "a PNG"), (b"\xff\xd8\xff", "a JPEG"), (b"GIF8", "a GIF"), (b"BM", "a BMP")):
        if data[:len(magic)] == magic:
            return name
    return "a WebP" if data[:4] == b"RIFF" and data[8:12] == b"WEBP" else ""


def _decode_video(data: bytes, limits: MediaLimits, **sampling: int | float | None) -> VideoClip:
    with _first_stream(data, "video", VIDEO_CONTAINERS, "decoding a video") as (av, container, stream):
        rate = stream.average_rate or stream.guessed_rate
        source_fps = float(rate) if rate else None
        total = stream.frames
        if total <= 0:  # some containers do not record a count: count packets without decoding
            with av.open(io.BytesIO(data), options={"format_whitelist": VIDEO_CONTAINERS}) as probe:
                total = sum(1 for p in probe.demux(probe.streams.video[0]) if p.size)
        if total <= 0:
            raise MediaError("video has no frames (empty or truncated)")
        if total > limits.max_video_source_frames:
            raise MediaError(f"video has {total} frames, over the limit of {limits.max_video_source_frames}")
        indices = sample_frame_indices(total, source_fps=source_fps, limit=limits.max_video_frames, **sampling)
        _check_video_pixels(len(indices), stream.codec_context.width or 1, stream.codec_context.height or 1,
                            limits)
        wanted, last = set(indices), indices[-1]
        frames: list[Image.Image] = []
        decoded = 0
        for frame in container.decode(stream):
            if decoded in wanted:
                _check_image_size(frame.width, frame.height, limits)
                frames.append(frame.to_image())
            decoded += 1
            if decoded > last:
                break
    if len(frames) < len(indices):
        raise MediaError(f"video is truncated or corrupt: decoded {decoded} of {total} declared frames")
    if len({im.size for im in frames}) != 1:
        raise MediaError("video frames change size mid-stream; not supported")
    return VideoClip([to_rgb(f) for f in frames], source_fps, total, indices)


def load_video(src: Any, *, limits: MediaLimits, fps: float | None = None, max_frames: int | None = None,
               num_frames: int | None = None) -> VideoClip:
    """Sampled RGB frames of a video given as a path, URL, bytes, base64, data URI (decoded
    with PyAV), or as a list of frames / a THWC uint8 array (kept as is, no sampling).

    Sampling (see `sample_frame_indices`): `num_frames` exactly, else `fps` frames per
    second of source, else every frame; then at most `max_frames` and
    `limits.max_video_frames`. A video whose sampled frames cannot all be decoded
    (truncated, corrupt) raises MediaError.
    """
    for name, value in (("fps", fps), ("max_frames", max_frames), ("num_frames", num_frames)):
        if value is not None and not value > 0:
            raise ValueError(f"video sampling parameter {name} must be positive, got {value!r}")
    if isinstance(src, VideoClip):  # already loaded: re-validate, keep its metadata
        checked = _frames_from_list(src.frames, limits)
        return VideoClip(checked.frames, src.fps, src.total_num_frames, list(src.sampled_indices))
    if isinstance(src, (list, tuple)):
        return _frames_from_list(src, limits)
    if isinstance(src, Image.Image):
        raise MediaError("video source is a single image; a video is a list of frames "
                         "(and video_data a list of videos)")
    if isinstance(src, (np.ndarray, torch.Tensor)):
        if src.ndim != 4:
            raise MediaError(f"video array must have shape TxHxWxC, got {tuple(src.shape)}")
        return _frames_from_list(list(src), limits)
    if not isinstance(src, (str, os.PathLike, bytes, bytearray, memoryview)):
        raise MediaError(f"unsupported video source type {type(src).__name__}")
    data = read_media_bytes(src, modality=Modality.VIDEO, limits=limits)
    return _decode_video(data, limits, fps=fps, max_frames=max_frames, num_frames=num_frames)


# ---------------------------------------------------------------- audio


def resample_audio(x: np.ndarray, orig_sr: int, target_sr: int) -> np.ndarray:
    """Mono float32 `x` resampled with libswresample (PyAV); identity when rates match."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if orig_sr == target_sr or x.size == 0:
        return x
    av = _import_av(f"resampling audio from {orig_sr} Hz to {target_sr} Hz")
    resampler = av.AudioResampler(format="flt", layout="mono", rate=target_sr)
    frame = av.AudioFrame.from_ndarray(x[None, :], format="flt", layout="mono")
    frame.sample_rate = orig_sr
    out = [f.to_ndarray().reshape(-1) for f in resampler.resample(frame)]
    out += [f.to_ndarray().reshape(-1) for f in resampler.resample(None)]  # flush the filter delay
    return np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)


def _check_duration(num_samples: int, rate: int, limits: MediaLimits) -> None:
    if rate <= 0:
        raise MediaError(f"audio has an invalid sample rate {rate}")
    if num_samples / rate > limits.max_audio_seconds:
        raise MediaError(
            f"audio is {num_samples / rate:.1f} s long, over the limit of {limits.max_audio_seconds:g} s"
        )


def _decode_audio_soundfile(data: bytes, limits: MediaLimits) -> tuple[np.ndarray, int] | None:
    """(mono, rate) via libsndfile, or None when libsndfile does not recognise the format (or
    soundfile is not installed)."""
    sf = _import_soundfile()
    if sf is None:
        return None
    try:
        info = sf.info(io.BytesIO(data))
    except Exception:  # noqa: BLE001 - not a libsndfile format: the PyAV path decides
        return None
    _check_duration(info.frames, info.samplerate, limits)
    try:
        x, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception as e:  # noqa: BLE001 - recognised header, corrupt body
        raise MediaError(f"corrupt audio data: {type(e).__name__}: {e}") from e
    return x.mean(axis=1), int(rate)


def _decode_audio_pyav(data: bytes, limits: MediaLimits) -> tuple[np.ndarray, int]:
    with _first_stream(data, "audio", AUDIO_CONTAINERS, "decoding this audio") as (av, container, stream):
        rate = int(stream.rate or 0)
        if container.duration is not None and container.duration / 1e6 > limits.max_audio_seconds:
            _check_duration(int(container.duration / 1e6 * max(rate, 1)), max(rate, 1), limits)
        # Planar float at the native rate and layout; channels are averaged below.
        to_float = av.AudioResampler(format="fltp")
        chunks: list[np.ndarray] = []
        num_samples = 0
        for frame in container.decode(stream):
            for f in to_float.resample(frame):
                arr = f.to_ndarray()
                chunks.append(arr.mean(axis=0))
                num_samples += arr.shape[1]
                rate = f.sample_rate
            _check_duration(num_samples, max(rate, 1), limits)
    if not chunks:
        raise MediaError("audio has no decodable samples (empty or truncated)")
    return np.concatenate(chunks), rate


def load_audio(src: Any, *, limits: MediaLimits, sampling_rate: int) -> np.ndarray:
    """Mono float32 waveform at `sampling_rate` from bytes, path, URL, base64, data URI
    (wav/flac/ogg via soundfile, mp3/aac/m4a/... via PyAV), a 1-D float array already at
    `sampling_rate`, or an `(array, rate)` tuple with array shape (samples,) or (samples, channels).
    """
    if not isinstance(sampling_rate, int) or sampling_rate <= 0:
        raise ValueError(f"sampling_rate must be a positive int, got {sampling_rate!r}")
    if isinstance(src, tuple) and len(src) == 2 and isinstance(src[1], (int, np.integer)):
        arr, rate = src
        x = _audio_array(arr)
        _check_duration(len(x), int(rate), limits)
        return _resample_checked(x, int(rate), sampling_rate)
    if isinstance(src, (np.ndarray, torch.Tensor)):
        x = _audio_array(src)
        _check_duration(len(x), sampling_rate, limits)
        return x
    if not isinstance(src, (str, os.PathLike, bytes, bytearray, memoryview)):
        raise MediaError(f"unsupported audio source type {type(src).__name__}")
    data = read_media_bytes(src, modality=Modality.AUDIO, limits=limits)
    decoded = _decode_audio_soundfile(data, limits)
    x, rate = decoded if decoded is not None else _decode_audio_pyav(data, limits)
    if not np.all(np.isfinite(x)):
        raise MediaError("audio contains non-finite samples")
    return _resample_checked(x, rate, sampling_rate)


def _resample_checked(x: np.ndarray, rate: int, sampling_rate: int) -> np.ndarray:
    try:
        return resample_audio(x, rate, sampling_rate)
    except MediaError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. a sample rate libswresample refuses
        raise MediaError(f"cannot resample audio from {rate} Hz: {type(e).__name__}: {e}") from e


def _audio_array(arr: Any) -> np.ndarray:
    x = arr.detach().cpu().numpy() if isinstance(arr, torch.Tensor) else np.asarray(arr)
    if not np.issubdtype(x.dtype, np.floating):
        raise MediaError(f"audio array must be floating point, got dtype {x.dtype}")
    if x.size == 0:
        raise MediaError(f"audio array is empty (shape {tuple(x.shape)})")
    if x.ndim == 2:
        x = x.mean(axis=1)
    if x.ndim != 1:
        raise MediaError(f"audio array must have shape (samples,) or (samples, channels), got {tuple(x.shape)}")
    if not np.all(np.isfinite(x)):
        raise MediaError("audio contains non-finite samples")
    return np.ascontiguousarray(x, dtype=np.float32)
