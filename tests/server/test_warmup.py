"""The HTTP server's warm-up request (entrypoints/warmup.py): it runs before /health answers 200 and before the
server says it is ready, with an image for a model that takes images."""

from __future__ import annotations

from tessera.entrypoints.warmup import local_url


def test_local_url_reaches_wildcard_addresses_through_loopback() -> None:
    assert local_url("0.0.0.0", 30000) == "http://127.0.0.1:30000"
    assert local_url("::", 8) == "http://[::1]:8"
    assert local_url("fe80::1", 8) == "http://[fe80::1]:8"
    assert local_url("localhost", 8) == "http://localhost:8"


def test_the_server_warms_up_before_it_says_it_is_ready(vl_server) -> None:
    out = vl_server.output()
    done, ready = out.find("warm-up requests done (4, each an image and text)"), out.find("Tessera is ready")
    assert 0 <= done < ready, out[-2000:]
    assert "warm-up requests failed" not in out
