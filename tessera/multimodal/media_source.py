"""Turning an untrusted media reference into bytes: URLs, data URIs, base64, local files.

Contract: `read_media_bytes` either returns at most `limits.max_bytes_for(modality)` bytes or
raises `MediaError`. It never reads a local file outside the allowed directory, never connects
to a private/loopback/link-local address unless `limits.allow_private_urls` (checked on every
connection, so redirects and DNS answers are covered), never uses environment proxies, and
stops streaming as soon as the byte cap or the wall-clock timeout is exceeded.
"""

from __future__ import annotations

import base64
import binascii
import functools
import http.client
import ipaddress
import os
import re
import socket
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

from tessera.multimodal.items import Modality

_MiB = 1 << 20
_CHUNK = 64 * 1024
# Bare base64 (standard alphabet). Checked after stripping whitespace, with length % 4 == 0.
_BASE64_RE = re.compile(r"[A-Za-z0-9+/]+={0,2}")
_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


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
        if self.max_redirects < 0:
            raise ValueError(f"MediaLimits.max_redirects must be >= 0, got {self.max_redirects}")

    @classmethod
    def from_server_args(cls, args: Any) -> MediaLimits:
        """Limits for a ServerArgs. Reads `allowed_local_media_path` and, where ServerArgs has
        them, `allow_private_media_urls` and `max_image_pixels`; other limits keep their defaults."""
        kwargs: dict[str, Any] = {"allowed_local_media_path": args.allowed_local_media_path}
        for arg_name, field_name in (("allow_private_media_urls", "allow_private_urls"),
                                     ("max_image_pixels", "max_image_pixels")):
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


def read_media_bytes(src: str | os.PathLike[str] | bytes | bytearray | memoryview, *,
                     modality: Modality, limits: MediaLimits) -> bytes:
    """Bytes of an encoded media file named by `src` (see module contract).

    Strings are read as: `data:` URI, `http(s)://` URL, `file://` URI, bare base64 (when the
    whole string is valid base64 and is not an allowed existing file), else a local path.
    """
    cap = limits.max_bytes_for(modality)
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
        _check_size(len(data), cap, modality, "payload")
        return data
    if isinstance(src, os.PathLike):
        return _read_local_file(os.fspath(src), modality=modality, limits=limits)
    if not isinstance(src, str):
        raise MediaError(f"unsupported {modality.value} source type {type(src).__name__}")
    s = src.strip()
    if not s:
        raise MediaError(f"empty {modality.value} source string")
    lower = s[:16].lower()
    if lower.startswith("data:"):
        return _decode_data_uri(s, cap=cap, modality=modality)
    if lower.startswith(("http://", "https://")):
        return fetch_url(s, modality=modality, limits=limits)
    if lower.startswith("file://"):
        return _read_local_file(_file_uri_path(s), modality=modality, limits=limits)
    if _SCHEME_RE.match(s):
        scheme = s.split("://", 1)[0]
        raise MediaError(f"unsupported URL scheme {scheme!r} for {modality.value} (use http, https, file or data)")
    compact = "".join(s.split())
    if len(compact) % 4 == 0 and _BASE64_RE.fullmatch(compact):
        # JPEG base64 starts with "/9j/", so a string can be both; an allowed existing file wins.
        if _local_file_allowed(s, limits):
            return _read_local_file(s, modality=modality, limits=limits)
        return _decode_base64(compact, cap=cap, modality=modality)
    return _read_local_file(s, modality=modality, limits=limits)


# ---------------------------------------------------------------- inline payloads


def _check_size(size: int, cap: int, modality: Modality, what: str) -> None:
    if size > cap:
        raise MediaError(f"{modality.value} {what} is {size} bytes, over the limit of {cap} bytes")


def _decode_base64(text: str, *, cap: int, modality: Modality) -> bytes:
    # Each 4 base64 characters carry 3 bytes: refuse oversized payloads before decoding them.
    _check_size(len(text) // 4 * 3, cap, modality, "base64 payload")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise MediaError(f"invalid base64 {modality.value} data: {e}") from e


def _decode_data_uri(uri: str, *, cap: int, modality: Modality) -> bytes:
    header, sep, payload = uri.partition(",")
    if not sep:
        raise MediaError(f"malformed data URI for {modality.value}: missing ','")
    if header.lower().endswith(";base64"):
        return _decode_base64("".join(payload.split()), cap=cap, modality=modality)
    _check_size(len(payload), cap, modality, "data URI payload")
    return urllib.parse.unquote_to_bytes(payload)


# ---------------------------------------------------------------- local files


def _parse_url(url: str) -> urllib.parse.ParseResult:
    try:
        return urllib.parse.urlparse(url)
    except ValueError as e:  # e.g. "Invalid IPv6 URL"
        raise MediaError(f"malformed URL {url[:200]!r}: {e}") from e


def _file_uri_path(uri: str) -> str:
    parsed = _parse_url(uri)
    if parsed.netloc not in ("", "localhost"):
        raise MediaError(f"file URI with a remote host {parsed.netloc!r} is not supported")
    return urllib.parse.unquote(parsed.path)


def _resolve_allowed(path: str, limits: MediaLimits) -> str:
    """The real path of `path` if policy allows reading it; raises MediaError otherwise."""
    if limits.allowed_local_media_path is None and not limits.allow_any_local_path:
        raise MediaError("local media files are not allowed (no allowed_local_media_path is configured)")
    try:
        root = None if limits.allow_any_local_path else os.path.realpath(limits.allowed_local_media_path or "/")
        # realpath resolves symlinks and '..' so a link inside the root cannot escape it.
        real = os.path.realpath(os.path.expanduser(path))
    except (ValueError, OSError) as e:  # e.g. embedded NUL byte
        raise MediaError(f"invalid local media path: {e}") from e
    if root is not None:
        if os.path.commonpath([real, root]) != root:
            raise MediaError(f"local media path {path!r} is outside the allowed directory")
    return real


def _local_file_allowed(path: str, limits: MediaLimits) -> bool:
    try:
        return os.path.isfile(_resolve_allowed(path, limits))
    except MediaError:
        return False


def _read_local_file(path: str, *, modality: Modality, limits: MediaLimits) -> bytes:
    real = _resolve_allowed(path, limits)
    cap = limits.max_bytes_for(modality)
    if not os.path.exists(real):
        raise MediaError(f"local media file {path!r} does not exist")
    if not os.path.isfile(real):  # directories, FIFOs (a read would block), devices
        raise MediaError(f"local media path {path!r} is not a regular file")
    try:
        # O_NOFOLLOW: the final component was resolved above; refuse if it became a link since.
        fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise MediaError(f"cannot open local media file {path!r}: {e.strerror}") from e
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise MediaError(f"local media path {path!r} is not a regular file")
        _check_size(os.fstat(f.fileno()).st_size, cap, modality, "file")
        try:
            data = f.read(cap + 1)
        except OSError as e:
            raise MediaError(f"cannot read local media file {path!r}: {e.strerror}") from e
    _check_size(len(data), cap, modality, "file")
    return data


# ---------------------------------------------------------------- URLs


def _is_public_ip(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def _guarded_create_connection(address: tuple[str, int], timeout: float | None = None,
                               source_address: tuple[str, int] | None = None, *,
                               allow_private: bool) -> socket.socket:
    """socket.create_connection that validates every resolved address and connects to the
    validated IP itself, so a second DNS answer cannot swap in a private address."""
    host, port = address
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise MediaError(f"cannot resolve URL host {host!r}: {e}", status=422) from e
    ips = [info[4][0] for info in infos]
    if not allow_private:
        for ip in ips:
            if not _is_public_ip(ipaddress.ip_address(ip.split("%", 1)[0])):
                raise MediaError(f"URL host {host!r} resolves to a non-public address ({ip}); refused")
    last: OSError | None = None
    for ip in ips:
        try:
            return socket.create_connection((ip, port), timeout, source_address)
        except OSError as e:
            last = e
    raise MediaError(f"cannot connect to URL host {host!r}: {last}", status=422)


class _GuardedHTTPConnection(http.client.HTTPConnection):
    def __init__(self, *args: object, allow_private: bool, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._create_connection = functools.partial(_guarded_create_connection, allow_private=allow_private)


class _GuardedHTTPSConnection(http.client.HTTPSConnection):
    def __init__(self, *args: object, allow_private: bool, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._create_connection = functools.partial(_guarded_create_connection, allow_private=allow_private)


class _GuardedHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, allow_private: bool) -> None:
        super().__init__()
        self._allow_private = allow_private

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_GuardedHTTPConnection, allow_private=self._allow_private), req)


class _GuardedHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, allow_private: bool) -> None:
        super().__init__()
        self._allow_private = allow_private

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_GuardedHTTPSConnection, allow_private=self._allow_private), req,
                            context=self._context)


class _RedirectHandler(urllib.request.HTTPRedirectHandler):
    """Follows at most `max_redirections` redirects, only to http(s); the connection guard
    re-checks the new host's addresses."""

    def __init__(self, max_redirects: int) -> None:
        super().__init__()
        self.max_redirections = max_redirects
        self.max_repeats = max_redirects

    def http_error_302(self, req, fp, code, msg, headers):  # type: ignore[no-untyped-def]
        # Checked here, before urllib's own scheme check, so the refusal is a 400 that says why.
        location = headers.get("Location") or headers.get("URI") or ""
        newurl = urllib.parse.urljoin(req.full_url, location)
        if _parse_url(newurl).scheme.lower() not in ("http", "https"):
            raise MediaError(f"URL redirected to a non-http(s) location {newurl!r}; refused")
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


def fetch_url(url: str, *, modality: Modality, limits: MediaLimits) -> bytes:
    """GET `url` under the limits: byte cap enforced while streaming, whole-download deadline."""
    cap = limits.max_bytes_for(modality)
    timeout = limits.url_timeout_for(modality)
    parsed = _parse_url(url)
    try:
        hostname = parsed.hostname
    except ValueError as e:
        raise MediaError(f"malformed URL {url[:200]!r}: {e}") from e
    if not hostname:
        raise MediaError(f"URL {url!r} has no host")
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}),  # a proxy would make the address check meaningless
        _GuardedHTTPHandler(limits.allow_private_urls),
        _GuardedHTTPSHandler(limits.allow_private_urls),
        _RedirectHandler(limits.max_redirects),
    )
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(url, headers={"User-Agent": "tessera-media/1"})
    try:
        with opener.open(request, timeout=timeout) as resp:
            declared = resp.headers.get("Content-Length")
            if declared is not None and declared.isdigit():
                _check_size(int(declared), cap, modality, "download")
            chunks: list[bytes] = []
            total = 0
            while True:
                if time.monotonic() > deadline:
                    raise MediaError(f"fetching {modality.value} URL timed out after {timeout:g} s", status=422)
                chunk = resp.read(_CHUNK)
                if not chunk:
                    break
                total += len(chunk)
                _check_size(total, cap, modality, "download")
                chunks.append(chunk)
    except MediaError:
        raise
    except urllib.error.HTTPError as e:
        raise MediaError(f"{modality.value} URL returned HTTP {e.code} {e.reason}", status=422) from e
    except urllib.error.URLError as e:
        if isinstance(e.reason, MediaError):
            raise e.reason from e
        raise MediaError(f"cannot fetch {modality.value} URL: {e.reason}", status=422) from e
    except (TimeoutError, socket.timeout) as e:
        raise MediaError(f"fetching {modality.value} URL timed out after {timeout:g} s", status=422) from e
    except (OSError, http.client.HTTPException, ValueError) as e:
        raise MediaError(f"cannot fetch {modality.value} URL: {e}", status=422) from e
    return b"".join(chunks)
