"""Image loading from every source kind, and every way it must refuse bad input."""

from __future__ import annotations

import base64
import os
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from tessera.messages.items import Modality
from tessera.multimodal.media import MediaError, MediaLimits, load_image

from .conftest import encode_png, scene_image

OFFLINE = MediaLimits.offline()


def _assert_same(a: Image.Image, b: Image.Image) -> None:
    assert a.mode == b.mode == "RGB" and a.size == b.size
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_all_inline_sources_decode_to_the_same_rgb(tmp_path):
    img = scene_image(1)
    png = encode_png(img)
    b64 = base64.b64encode(png).decode()
    path = tmp_path / "scene.png"
    path.write_bytes(png)
    limits = MediaLimits(allowed_local_media_path=str(tmp_path))
    sources = [img, np.asarray(img), torch.from_numpy(np.asarray(img).copy()), png, bytearray(png),
               b64, "data:image/png;base64," + b64, str(path), path, f"file://{path}"]
    for src in sources:
        _assert_same(load_image(src, limits=limits), img)


def test_converts_modes_to_rgb_like_transformers():
    from transformers.image_transforms import convert_to_rgb

    rng = np.random.default_rng(0)
    rgba = Image.fromarray(rng.integers(0, 256, (6, 8, 4), dtype=np.uint8), "RGBA")
    palette = Image.new("RGB", (8, 6), (200, 10, 10)).convert("P")
    palette.info["transparency"] = 0
    for img in (rgba, rgba.convert("LA"), palette, rgba.convert("L"), rgba.convert("CMYK")):
        expected = convert_to_rgb(img, return_numpy=True)
        assert np.array_equal(np.asarray(load_image(img, limits=OFFLINE)), expected), img.mode
        assert np.array_equal(np.asarray(load_image(encode_png(img) if img.mode != "CMYK" else img,
                                                    limits=OFFLINE)), expected), img.mode
    assert load_image(np.asarray(rgba), limits=OFFLINE).getpixel((0, 0)) == tuple(
        convert_to_rgb(rgba, return_numpy=True)[0, 0])
    assert load_image(np.full((6, 8), 7, np.uint8), limits=OFFLINE).getpixel((0, 0)) == (7, 7, 7)


def _png_header_claiming(width: int, height: int) -> bytes:
    """A PNG signature + IHDR for a huge image, then a tiny IDAT: decoding it would be a bomb."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16))


@pytest.mark.parametrize(
    ("src", "limits", "message"),
    [
        (b"definitely not an image", OFFLINE, "not a recognised image"),
        (encode_png(scene_image(2))[:200], OFFLINE, "corrupt or truncated"),
        ("data:image/png;base64,!!!not-base64!!!", OFFLINE, "invalid base64"),
        ("iVBORw0KGgo=", OFFLINE, "not a recognised image"),  # valid base64, truncated PNG signature
        (12345, OFFLINE, "unsupported image source type int"),
        ({"url": "x"}, OFFLINE, "unsupported image source type dict"),
        (np.zeros((4, 4, 3), np.float32), OFFLINE, "uint8"),
        (np.zeros((4, 4, 5), np.uint8), OFFLINE, "shape"),
        (Image.new("RGB", (200, 100)), MediaLimits(max_image_pixels=10_000),
         "over the limit of 10000 \\(the server's --max-image-pixels\\)"),
        (encode_png(Image.new("RGB", (200, 100))), MediaLimits(max_image_pixels=10_000), "over the limit"),
        # The pixel cap is checked from the header, before any decode of 10^10 pixels.
        (_png_header_claiming(100_000, 100_000), OFFLINE, "over the limit"),
        (b"x" * 2000, MediaLimits(max_image_bytes=1000), "over the limit of 1000 bytes"),
        ("gopher://example.com/x.png", OFFLINE, "unsupported URL scheme 'gopher'"),
        ("", OFFLINE, "empty image source"),
    ],
)
def test_bad_images_raise_media_error(src, limits, message):
    with pytest.raises(MediaError, match=message) as info:
        load_image(src, limits=limits)
    assert info.value.status == 400


def test_eps_is_not_an_accepted_format():
    # EPS would run Ghostscript on untrusted input; the format allow-list must keep it out.
    with pytest.raises(MediaError, match="not a recognised image"):
        load_image(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", limits=OFFLINE)


# ---------------------------------------------------------------- local file policy


@pytest.fixture
def media_root(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "ok.png").write_bytes(encode_png(scene_image(3)))
    secret = tmp_path / "secret.png"
    secret.write_bytes(encode_png(scene_image(4)))
    os.symlink(secret, root / "escape.png")
    os.symlink(root / "ok.png", root / "inside_link.png")
    return root, secret


def test_limits_from_server_args_and_validation():
    from types import SimpleNamespace

    limits = MediaLimits.from_server_args(SimpleNamespace(allowed_local_media_path="/srv/media"))
    assert limits.allowed_local_media_path == "/srv/media" and not limits.allow_private_urls
    assert limits.url_timeout_for(Modality.IMAGE) == 5.0 and limits.url_timeout_for(Modality.VIDEO) == 30.0
    assert limits.url_timeout_for(Modality.AUDIO) == 10.0
    with pytest.raises(ValueError, match="max_image_pixels must be positive"):
        MediaLimits(max_image_pixels=0)


def test_local_files_refused_without_an_allowed_directory(media_root):
    root, _ = media_root
    with pytest.raises(MediaError, match="local media files are not allowed"):
        load_image(str(root / "ok.png"), limits=MediaLimits())


def test_local_file_policy(media_root):
    root, secret = media_root
    limits = MediaLimits(allowed_local_media_path=str(root))
    assert load_image(str(root / "ok.png"), limits=limits).size == scene_image(3).size
    assert load_image(str(root / "inside_link.png"), limits=limits).size == scene_image(3).size
    for bad in (str(secret), str(root / "escape.png"), str(root / ".." / "secret.png"),
                os.path.relpath(secret), f"file://{secret}"):
        with pytest.raises(MediaError, match="outside the allowed directory"):
            load_image(bad, limits=limits)
    with pytest.raises(MediaError, match="does not exist"):
        load_image(str(root / "missing.png"), limits=limits)
    with pytest.raises(MediaError, match="not a regular file"):
        load_image(str(root), limits=limits)
    with pytest.raises(MediaError, match="over the limit"):
        load_image(str(root / "ok.png"), limits=MediaLimits(allowed_local_media_path=str(root), max_image_bytes=10))
    # The offline engine's trusted mode reads any path.
    assert load_image(str(secret), limits=MediaLimits.offline()).size == scene_image(4).size


# ---------------------------------------------------------------- URLs


def test_url_fetch_and_its_failures(media_server):
    png = encode_png(scene_image(5))
    routes = media_server.routes
    routes["/ok.png"] = (200, {}, png)
    routes["/big.png"] = (200, {}, png + b"\0" * 4096)
    # No Content-Length (HTTP/1.0, body until close): the cap must hold while streaming.
    routes["/stream.png"] = (200, {"X-No-Length": "1"}, png + b"\0" * 4096)
    routes["/moved"] = (302, {"Location": "/ok.png"}, b"")
    routes["/to-file"] = (302, {"Location": "file:///etc/passwd"}, b"")
    base = media_server.base_url
    allowed = MediaLimits(allow_private_urls=True)
    assert load_image(base + "/ok.png", limits=allowed).size == scene_image(5).size
    assert load_image(base + "/moved", limits=allowed).size == scene_image(5).size

    capped = MediaLimits(allow_private_urls=True, max_image_bytes=len(png) + 100)
    for path in ("/big.png", "/stream.png"):
        with pytest.raises(MediaError, match="over the limit") as info:
            load_image(base + path, limits=capped)
        assert info.value.status == 400

    with pytest.raises(MediaError, match="HTTP 404") as info:
        load_image(base + "/missing.png", limits=allowed)
    assert info.value.status == 422

    with pytest.raises(MediaError, match="non-http"):
        load_image(base + "/to-file", limits=allowed)

    with pytest.raises(MediaError, match="non-public address") as info:
        load_image(base + "/ok.png", limits=MediaLimits())
    assert info.value.status == 400


def test_unreachable_url_is_422():
    # Port 9 (discard) on loopback: nothing listens, the connection is refused at once.
    with pytest.raises(MediaError, match="cannot") as info:
        load_image("http://127.0.0.1:9/x.png", limits=MediaLimits(allow_private_urls=True))
    assert info.value.status == 422


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]", "10.1.2.3", "169.254.169.254", "[::ffff:127.0.0.1]",
                                  "0.0.0.0", "localhost"])
def test_private_hosts_refused_before_connecting(host):
    with pytest.raises(MediaError, match="resolves to"):
        load_image(f"http://{host}:1/x.png", limits=MediaLimits())
