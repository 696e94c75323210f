"""SSRF defences of the URL loader, against real loopback servers that count their hits: a refused URL must
cost the target nothing (0 hits), every redirect hop is checked, the checked address is the one connected to,
and a server that drips bytes cannot hold a fetch past the modality's timeout."""

from __future__ import annotations

import http.server
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from tessera.messages.items import Modality
from tessera.multimodal.media_limits import MediaError, MediaLimits
from tessera.multimodal.media_url import address_refusal, fetch_url

from .conftest import encode_png, scene_image

PNG = encode_png(scene_image(1, (16, 16)))


class CountingServer:
    """Loopback HTTP/1.0 server. Routes: path -> ("ok", body) | ("redirect", location) | ("drip", seconds
    per byte) | ("slow-headers", seconds per header line)."""

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.routes: dict[str, tuple[str, Any]] = {}
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            timeout = 10

            def do_GET(self) -> None:  # noqa: N802 - http.server API
                outer.hits[self.path] += 1
                kind, arg = outer.routes.get(self.path, ("missing", None))
                try:
                    if kind == "ok":
                        self.send_response(200)
                        self.send_header("Content-Length", str(len(arg)))
                        self.end_headers()
                        self.wfile.write(arg)
                    elif kind == "redirect":
                        self.send_response(302)
                        self.send_header("Location", arg)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                    elif kind == "drip":
                        self.send_response(200)
                        self.end_headers()
                        for _ in range(200):
                            self.wfile.write(b"x")
                            self.wfile.flush()
                            time.sleep(arg)
                    elif kind == "slow-headers":
                        self.wfile.write(b"HTTP/1.0 200 OK\r\n")
                        for i in range(200):
                            self.wfile.write(f"X-Slow-{i}: 1\r\n".encode())
                            self.wfile.flush()
                            time.sleep(arg)
                    else:
                        self.send_error(404)
                except OSError:  # the client gave up: expected for the slow routes
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def servers() -> Iterator[tuple[CountingServer, CountingServer]]:
    a, b = CountingServer(), CountingServer()
    yield a, b
    a.close()
    b.close()


def fetch(url: str, **limits: Any) -> bytes:
    return fetch_url(url, modality=Modality.IMAGE, limits=MediaLimits(**limits))


def test_private_target_refused_without_a_single_hit(servers):
    a, _ = servers
    a.routes["/img.png"] = ("ok", PNG)
    for host in ("127.0.0.1", "localhost", "[::ffff:127.0.0.1]"):
        with pytest.raises(MediaError, match="--allow-private-media-urls"):
            fetch(a.url("/img.png", host))
    assert a.hits["/img.png"] == 0
    assert fetch(a.url("/img.png"), allow_private_urls=True) == PNG
    assert a.hits["/img.png"] == 1


@pytest.mark.parametrize("target", ["http://169.254.169.254/latest/meta-data/", "http://[fe80::1]/",
                                    "http://[::ffff:169.254.169.254]/", "http://[fd00:ec2::254]/"])
def test_redirect_to_metadata_refused_even_when_private_urls_are_allowed(servers, target):
    a, _ = servers
    a.routes["/r"] = ("redirect", target)
    with pytest.raises(MediaError, match="link-local or cloud-metadata"):
        fetch(a.url("/r"), allow_private_urls=True)
    assert a.hits["/r"] == 1


def test_every_redirect_hop_is_checked(servers):
    a, b = servers
    b.routes["/img.png"] = ("ok", PNG)
    a.routes["/hop1"] = ("redirect", a.url("/hop2"))
    a.routes["/hop2"] = ("redirect", b.url("/img.png"))
    assert fetch(a.url("/hop1"), allow_private_urls=True) == PNG  # both hops allowed: it arrives
    # Only `localhost` is on the allowlist: the second hop names 127.0.0.1 and is refused before connecting.
    a.routes["/hop1"] = ("redirect", a.url("/hop2", "localhost"))
    with pytest.raises(MediaError, match="not in --allowed-media-domains"):
        fetch(a.url("/hop1", "localhost"), allow_private_urls=True, allowed_media_domains=("localhost",))
    assert b.hits["/img.png"] == 1  # only the first, allowed fetch reached it
    with pytest.raises(MediaError, match="not in --allowed-media-domains"):
        fetch(b.url("/img.png"), allow_private_urls=True, allowed_media_domains=("*.example.com",))
    assert b.hits["/img.png"] == 1
    a.routes["/loop"] = ("redirect", "/loop")
    with pytest.raises(MediaError):
        fetch(a.url("/loop"), allow_private_urls=True)
    assert a.hits["/loop"] <= 6


def test_the_checked_address_is_the_one_connected_to(servers, monkeypatch):
    """DNS rebinding: a name that answers one address to the check and another later must not reach the
    second. The loader resolves once per connection and connects to the address it checked."""
    a, b = servers
    a.routes["/img.png"] = b.routes["/img.png"] = ("ok", PNG)
    real = socket.getaddrinfo
    answers = iter([a.port, b.port, b.port, b.port])

    def rebinding(host, port, *args, **kwargs):
        if host == "rebind.test":
            return real("127.0.0.1", next(answers), *args, **kwargs)
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    assert fetch("http://rebind.test/img.png", allow_private_urls=True) == PNG
    assert (a.hits["/img.png"], b.hits["/img.png"]) == (1, 0)
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: real("127.0.0.1", 9, *a[2:], **k))
    with pytest.raises(MediaError, match="non-public"):
        fetch("http://public-looking.test/img.png")


@pytest.mark.parametrize("route", [("drip", 0.05), ("slow-headers", 0.05)])
def test_a_dripping_server_cannot_outlast_the_timeout(servers, route):
    a, _ = servers
    a.routes["/slow"] = route
    start = time.monotonic()
    with pytest.raises(MediaError, match="timed out") as info:
        fetch(a.url("/slow"), allow_private_urls=True, image_url_timeout_s=0.5)
    assert info.value.status == 422
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("address, allow_private, refused", [
    ("8.8.8.8", False, None), ("2606:4700:4700::1111", False, None),
    ("127.0.0.1", False, "non-public"), ("127.0.0.1", True, None), ("10.0.0.1", False, "non-public"),
    ("192.168.1.1", True, None), ("100.64.0.1", False, "non-public"), ("::1", False, "non-public"),
    ("fc00::1", False, "non-public"), ("::ffff:10.0.0.1", False, "non-public"), ("::ffff:10.0.0.1", True, None),
    ("169.254.169.254", True, "link-local"), ("169.254.1.1", True, "link-local"), ("fe80::1%eth0", True, "link-local"),
    ("::ffff:169.254.169.254", True, "link-local"), ("2002:a9fe:a9fe::1", True, "link-local"),
    ("64:ff9b::a9fe:a9fe", True, "link-local"), ("::169.254.169.254", True, "link-local"),
    ("fd00:ec2::254", True, "link-local"), ("100.100.100.200", True, "link-local"),
    ("224.0.0.1", True, "multicast"), ("ff02::1", True, "multicast"), ("0.0.0.0", True, "unspecified"),
    ("::", True, "unspecified"), ("240.0.0.1", True, "reserved"), ("2002:7f00:1::", False, "non-public"),
])
def test_address_classes(address, allow_private, refused):
    why = address_refusal(address, allow_private)
    assert (why is None) if refused is None else (refused in why), why
