"""Turning an untrusted media reference into bytes: URLs, data URIs, base64, local files.

Contract: `read_media_bytes` either returns at most `limits.max_bytes_for(modality)` bytes or
raises `MediaError`. It never reads a local file outside the allowed directory, never connects
to a loopback/private address unless `limits.allow_private_urls`, never to a link-local, cloud-metadata,
multicast or reserved one (IPv6 forms that embed an IPv4 address are judged by it), never to a host outside
`limits.allowed_media_domains` when that is set. Every connection (each redirect hop) is checked and pinned
to the address that was checked, so a second DNS answer cannot swap in another. It never uses environment
proxies, and stops as soon as the byte cap or the modality's wall-clock timeout is exceeded.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import ipaddress
import os
import re
import socket
import stat
import threading
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
        raise MediaError("local media files are not allowed; start the server with --allowed-local-media-path DIR "
                         "(Engine: allowed_local_media_path=DIR) to allow the files under DIR")
    try:
        root = None if limits.allow_any_local_path else os.path.realpath(limits.allowed_local_media_path or "/")
        # realpath resolves symlinks and '..' so a link inside the root cannot escape it.
        real = os.path.realpath(os.path.expanduser(path))
    except (ValueError, OSError) as e:  # e.g. embedded NUL byte
        raise MediaError(f"invalid local media path: {e}") from e
    if root is not None:
        if os.path.commonpath([real, root]) != root:
            raise MediaError(f"local media path {path!r} is outside the allowed directory "
                             f"(--allowed-local-media-path)")
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


# Never fetched, whatever the flags: link-local (169.254.0.0/16 holds the clouds' metadata services, fe80::/10)
# and the metadata addresses that sit outside it (AWS's IPv6 endpoint, Alibaba's).
_ALWAYS_REFUSED = [ipaddress.ip_network(n) for n in ("169.254.0.0/16", "fe80::/10", "fd00:ec2::254/128",
                                                     "100.100.100.200/32")]
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 form carries (mapped, compatible, 6to4, Teredo, NAT64), if any: each of them
    reaches that IPv4 host, so it is judged as that host."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if int(ip) >> 32 == 0 and int(ip) > 1:  # ::a.b.c.d (IPv4-compatible, deprecated but routed by some stacks)
        return ipaddress.IPv4Address(int(ip))
    return None


def address_refusal(ip_text: str, allow_private: bool) -> str | None:
    """Why a connection to this address is refused, or None if it is allowed.

    Refused always: link-local and cloud-metadata, multicast, unspecified, reserved. Refused unless
    allow_private: loopback and private/shared ranges (RFC 1918, CGNAT, unique-local, site-local)."""
    ip = ipaddress.ip_address(ip_text.split("%", 1)[0])
    addresses = [ip]
    if isinstance(ip, ipaddress.IPv6Address) and (v4 := _embedded_ipv4(ip)) is not None:
        addresses = [v4]  # the IPv6 form only carries it: the IPv4 host is where the packets go
    private = False
    for a in addresses:
        if any(a in net for net in _ALWAYS_REFUSED):
            return "a link-local or cloud-metadata address (refused even with --allow-private-media-urls)"
        if a.is_multicast or a.is_unspecified:
            return "a multicast or unspecified address"
        if a.is_reserved and not a.is_loopback:  # before is_private, which also covers 240.0.0.0/4
            return "a reserved address"
        if not a.is_global:
            private = True  # shared (CGNAT), documentation, benchmarking ranges: not on the public internet
    if private and not allow_private:
        return "a non-public address; start the server with --allow-private-media-urls to allow it"
    return None


def _host_allowed(host: str, domains: tuple[str, ...] | None) -> bool:
    """`domains` (from --allowed-media-domains): exact host names, or `*.example.com` for its subdomains."""
    if domains is None:
        return True
    host = host.lower().rstrip(".")
    return any(host == d or (d.startswith("*.") and host.endswith(d[1:])) for d in domains)


class _Fetch:
    """One download's policy and deadline. Every connection it opens (the first URL and each redirect hop)
    goes through `connect`; a watchdog shuts those sockets down when the deadline passes, so no slow server
    (headers or body dripping a byte at a time) holds a preprocessing thread past the modality's timeout."""

    def __init__(self, limits: MediaLimits, timeout: float) -> None:
        self.limits, self.timeout = limits, timeout
        self.deadline = time.monotonic() + timeout
        self.expired = False
        self._lock = threading.Lock()
        self._handles: list[socket.socket] = []  # our own dup of each connection's descriptor
        self._timer = threading.Timer(timeout, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> _Fetch:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
        with self._lock:
            for h in self._handles:
                h.close()
            self._handles.clear()

    def _expire(self) -> None:
        with self._lock:
            self.expired = True
            for h in self._handles:
                try:
                    h.shutdown(socket.SHUT_RDWR)  # wakes any recv blocked on this connection (TLS included)
                except OSError:
                    pass

    def check_host(self, host: str) -> None:
        if not _host_allowed(host, self.limits.allowed_media_domains):
            raise MediaError(f"URL host {host!r} is not in --allowed-media-domains")

    def connect(self, address: tuple[str, int], timeout: float | None = None,
                source_address: tuple[str, int] | None = None) -> socket.socket:
        """socket.create_connection that checks the host and every address it resolves to, then connects to
        a checked address itself: the address is pinned, so a second DNS answer cannot swap in another."""
        host, port = address
        self.check_host(host)
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            raise MediaError(f"cannot resolve URL host {host!r}: {e}", status=422) from e
        for info in infos:
            why = address_refusal(info[4][0], self.limits.allow_private_urls)
            if why is not None:
                raise MediaError(f"URL host {host!r} resolves to {info[4][0]}, {why}")
        last: OSError | None = None
        for family, type_, proto, _, sockaddr in infos:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0 or self.expired:
                break
            sock = socket.socket(family, type_, proto)
            try:
                sock.settimeout(min(remaining, timeout) if timeout else remaining)
                if source_address:
                    sock.bind(source_address)
                with self._lock:
                    self._handles.append(socket.socket(fileno=os.dup(sock.fileno())))
                    if self.expired:
                        raise TimeoutError("deadline passed")
                sock.connect(sockaddr)
                return sock
            except OSError as e:
                sock.close()
                last = e
        raise MediaError(f"cannot connect to URL host {host!r}: {last or 'timed out'}", status=422)


def _connection_class(base: type[http.client.HTTPConnection], fetch: _Fetch) -> type:
    class Guarded(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            self._create_connection = fetch.connect

    return Guarded


class _GuardedHTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, fetch: _Fetch) -> None:
        super().__init__()
        self._conn = _connection_class(http.client.HTTPConnection, fetch)

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self._conn, req)


class _GuardedHTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, fetch: _Fetch) -> None:
        super().__init__()
        self._conn = _connection_class(http.client.HTTPSConnection, fetch)

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(self._conn, req, context=self._context)


class _RedirectHandler(urllib.request.HTTPRedirectHandler):
    """Follows at most `max_redirections` redirects, only to http(s) hosts the allowlist admits; the
    connection of each hop checks its addresses again."""

    def __init__(self, fetch: _Fetch) -> None:
        super().__init__()
        self.fetch = fetch
        self.max_redirections = fetch.limits.max_redirects
        self.max_repeats = fetch.limits.max_redirects

    def http_error_302(self, req, fp, code, msg, headers):  # type: ignore[no-untyped-def]
        # Checked here, before urllib's own scheme check, so the refusal is a 400 that says why.
        location = headers.get("Location") or headers.get("URI") or ""
        newurl = urllib.parse.urljoin(req.full_url, location)
        parsed = _parse_url(newurl)
        if parsed.scheme.lower() not in ("http", "https"):
            raise MediaError(f"URL redirected to a non-http(s) location {newurl[:200]!r}; refused")
        try:
            host = parsed.hostname
        except ValueError as e:
            raise MediaError(f"URL redirected to a malformed location {newurl[:200]!r}: {e}") from e
        if not host:
            raise MediaError(f"URL redirected to a location without a host {newurl[:200]!r}; refused")
        self.fetch.check_host(host)
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
        raise MediaError(f"URL {url[:200]!r} has no host")
    timed_out = MediaError(f"fetching {modality.value} URL timed out after {timeout:g} s", status=422)
    with _Fetch(limits, timeout) as fetch:
        fetch.check_host(hostname)
        opener = urllib.request.build_opener(
            urllib.request.ProxyHandler({}),  # a proxy would make the address check meaningless
            _GuardedHTTPHandler(fetch), _GuardedHTTPSHandler(fetch), _RedirectHandler(fetch),
        )
        request = urllib.request.Request(url, headers={"User-Agent": "tessera-media/1"})
        try:
            with opener.open(request, timeout=timeout) as resp:
                declared = resp.headers.get("Content-Length")
                if declared is not None and declared.isdigit():
                    _check_size(int(declared), cap, modality, "download")
                chunks: list[bytes] = []
                total = 0
                while True:
                    chunk = resp.read1(_CHUNK)
                    if fetch.expired:
                        raise timed_out
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
            if fetch.expired:
                raise timed_out from e
            raise MediaError(f"cannot fetch {modality.value} URL: {e.reason}", status=422) from e
        except (TimeoutError, socket.timeout) as e:
            raise timed_out from e
        except (OSError, http.client.HTTPException, ValueError) as e:
            if fetch.expired:
                raise timed_out from e
            raise MediaError(f"cannot fetch {modality.value} URL: {e}", status=422) from e
    return b"".join(chunks)
