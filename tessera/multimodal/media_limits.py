"""The limits every media read runs under, and the one error it raises.

`MediaLimits` is the frozen policy (byte caps, download deadlines, decode bounds, which local files and
which URL hosts/addresses may be read), built once from ServerArgs or for the trusted offline Engine.
`MediaError` carries the HTTP status a server answers with. The readers live in media_source.py (the
dispatch, data URIs and base64), media_local.py (local files) and media_url.py (URLs, with the SSRF checks).
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import Any

from tessera.messages.items import Modality

_MiB = 1 << 20


class MediaError(ValueError):
    """Bad or unreachable media. `status` is the HTTP status a server should answer with:
    400 for media that is malformed, too large or not allowed, 422 for a URL that could not
    be fetched (unreachable host, timeout, HTTP error), 501 when decoding it needs an optional
    package that is not installed (PyAV for video)."""

    def __init__(self, message: str, *, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class MediaLimits:
    """Safety limits for loading media, validated once at construction.

    Local files: `allowed_local_media_path=None` refuses every local path unless
    `allow_any_local_path` (the offline Engine's trusted mode, see `MediaLimits.offline()`).
    Relative paths resolve against the process's working directory, then must lie under the root.
    Timeouts follow vLLM's defaults (image 5 s, video 30 s, audio 10 s) and bound the whole
    download, not only each socket read.
    """

    # ~67 Mpx. PIL's global Image.MAX_IMAGE_PIXELS (~89 Mpx) also applies: we do not mutate it.
    max_image_pixels: int = 64 * _MiB
    max_image_bytes: int = 32 * _MiB
    max_video_bytes: int = 512 * _MiB
    max_audio_bytes: int = 64 * _MiB
    image_url_timeout_s: float = 5.0
    video_url_timeout_s: float = 30.0
    audio_url_timeout_s: float = 10.0
    max_video_frames: int = 768  # frames kept after sampling
    max_video_source_frames: int = 100_000  # frames a video may declare/decode at all
    max_video_total_pixels: int = 256 * _MiB  # sampled frames x width x height
    max_audio_seconds: float = 1200.0
    allowed_local_media_path: str | None = None
    allow_any_local_path: bool = False
    allow_private_urls: bool = False
    # Host names URLs may name (every redirect hop too); None: any host. `*.example.com` admits subdomains.
    allowed_media_domains: tuple[str, ...] | None = None
    max_redirects: int = 5

    def __post_init__(self) -> None:
        for name in (
            "max_image_pixels", "max_image_bytes", "max_video_bytes", "max_audio_bytes",
            "max_video_frames", "max_video_source_frames", "max_video_total_pixels",
        ):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"MediaLimits.{name} must be positive, got {getattr(self, name)!r}")
        for name in ("image_url_timeout_s", "video_url_timeout_s", "audio_url_timeout_s", "max_audio_seconds"):
            if not float(getattr(self, name)) > 0:
                raise ValueError(f"MediaLimits.{name} must be positive, got {getattr(self, name)!r}")
        if self.allowed_media_domains is not None:
            domains = tuple(d.strip().lower().rstrip(".") for d in self.allowed_media_domains if d.strip())
            object.__setattr__(self, "allowed_media_domains", domains)
        if self.max_redirects < 0:
            raise ValueError(f"MediaLimits.max_redirects must be >= 0, got {self.max_redirects}")

    @classmethod
    def from_server_args(cls, args: Any) -> MediaLimits:
        """Limits for a ServerArgs. Reads `allowed_local_media_path` and, where ServerArgs has
        them, `allow_private_media_urls`, `max_image_pixels` and `allowed_media_domains`; other limits keep their defaults."""
        kwargs: dict[str, Any] = {"allowed_local_media_path": args.allowed_local_media_path}
        for arg_name, field_name in (("allow_private_media_urls", "allow_private_urls"),
                                     ("max_image_pixels", "max_image_pixels"),
                                     ("allowed_media_domains", "allowed_media_domains")):
            value = getattr(args, arg_name, None)
            if value is not None:
                kwargs[field_name] = value
        return cls(**kwargs)

    @classmethod
    def offline(cls, **overrides: object) -> MediaLimits:
        """Limits for the offline Engine: the caller is trusted with its own files and network."""
        kwargs: dict[str, object] = {"allow_any_local_path": True, "allow_private_urls": True}
        kwargs.update(overrides)
        return cls(**kwargs)  # type: ignore[arg-type]

    def max_bytes_for(self, modality: Modality) -> int:
        return {Modality.IMAGE: self.max_image_bytes, Modality.VIDEO: self.max_video_bytes,
                Modality.AUDIO: self.max_audio_bytes}[modality]

    def url_timeout_for(self, modality: Modality) -> float:
        return {Modality.IMAGE: self.image_url_timeout_s, Modality.VIDEO: self.video_url_timeout_s,
                Modality.AUDIO: self.audio_url_timeout_s}[modality]


def check_size(size: int, cap: int, modality: Modality, what: str) -> None:
    if size > cap:
        raise MediaError(f"{modality.value} {what} is {size} bytes, over the limit of {cap} bytes")


def parse_url(url: str) -> urllib.parse.ParseResult:
    try:
        return urllib.parse.urlparse(url)
    except ValueError as e:  # e.g. "Invalid IPv6 URL"
        raise MediaError(f"malformed URL {url[:200]!r}: {e}") from e
