"""Fetching a media URL without letting it reach what it must not (SSRF), and within its byte cap and deadline.

Every connection (the first URL and each redirect hop) resolves the host once, refuses link-local and
cloud-metadata addresses always and private ones unless allowed, and connects to the checked address itself
(pinned: a second DNS answer cannot swap in another); hosts may be limited to --allowed-media-domains;
no environment proxies. A watchdog shuts the sockets down at the modality's deadline, so a server that
drips bytes cannot hold a preprocessing thread longer.
"""

from __future__ import annotations

import http.client
import ipaddress
import os
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

from tessera.messages.items import Modality
from tessera.multimodal.media_limits import (
    MediaError,
    MediaLimits,
    check_size,
    parse_url,
)

_CHUNK = 64 * 1024


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
        if parse_url(newurl).scheme.lower() not in ("http", "https"):
            raise MediaError(f"URL redirected to a non-http(s) location {newurl[:200]!r}; refused")
        self.fetch.check_host(_host_of(newurl, "URL redirected to a location"))
        return super().http_error_302(req, fp, code, msg, headers)

    http_error_301 = http_error_303 = http_error_307 = http_error_308 = http_error_302


def _host_of(url: str, what: str) -> str:
    """The host `url` names; MediaError, saying `what` the URL is, when it is malformed or names none."""
    try:
        host = parse_url(url).hostname
    except ValueError as e:
        raise MediaError(f"{what} {url[:200]!r} is malformed: {e}") from e
    if not host:
        raise MediaError(f"{what} {url[:200]!r} has no host; refused")
    return host


def fetch_url(url: str, *, modality: Modality, limits: MediaLimits) -> bytes:
    """GET `url` under the limits: byte cap enforced while streaming, whole-download deadline."""
    cap = limits.max_bytes_for(modality)
    timeout = limits.url_timeout_for(modality)
    hostname = _host_of(url, "URL")
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
                    check_size(int(declared), cap, modality, "download")
                chunks: list[bytes] = []
                total = 0
                while True:
                    chunk = resp.read1(_CHUNK)
                    if fetch.expired:
                        raise timed_out
                    if not chunk:
                        break
                    total += len(chunk)
                    check_size(total, cap, modality, "download")
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
