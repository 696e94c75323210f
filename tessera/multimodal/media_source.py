"""Turning an untrusted media reference into bytes: URLs, data URIs, base64, local files.

Contract: `read_media_bytes` either returns at most `limits.max_bytes_for(modality)` bytes or
raises `MediaError`. It never reads a local file outside the allowed directory, never connects
to a loopback/private address unless `limits.allow_private_urls`, never to a link-local, cloud-metadata,
multicast or reserved one (IPv6 forms that embed an IPv4 address are judged by it), never to a host outside
`limits.allowed_media_domains` when that is set. Every connection (each redirect hop) is checked and pinned
to the address that was checked, so a second DNS answer cannot swap in another. It never uses environment
proxies, and stops as soon as the byte cap or the modality's wall-clock timeout is exceeded.

The readers behind it: media_local.py (local files), media_url.py (URLs and their SSRF checks); the limits
and the error are in media_limits.py. Data URIs and bare base64 are decoded here.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import urllib.parse

from tessera.messages.items import Modality
from tessera.multimodal.media_limits import MediaError, MediaLimits, check_size
from tessera.multimodal.media_local import (
    file_uri_path,
    local_file_allowed,
    read_local_file,
)
from tessera.multimodal.media_url import fetch_url

# Bare base64 (standard alphabet). Checked after stripping whitespace, with length % 4 == 0.
_BASE64_RE = re.compile(r"[A-Za-z0-9+/]+={0,2}")
_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def read_media_bytes(src: str | os.PathLike[str] | bytes | bytearray | memoryview, *,
                     modality: Modality, limits: MediaLimits) -> bytes:
    """Bytes of an encoded media file named by `src` (see module contract).

    Strings are read as: `data:` URI, `http(s)://` URL, `file://` URI, bare base64 (when the
    whole string is valid base64 and is not an allowed existing file), else a local path.
    """
    cap = limits.max_bytes_for(modality)
    if isinstance(src, (bytes, bytearray, memoryview)):
        data = bytes(src)
        check_size(len(data), cap, modality, "payload")
        return data
    if isinstance(src, os.PathLike):
        return read_local_file(os.fspath(src), modality=modality, limits=limits)
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
        return read_local_file(file_uri_path(s), modality=modality, limits=limits)
    if _SCHEME_RE.match(s):
        scheme = s.split("://", 1)[0]
        raise MediaError(f"unsupported URL scheme {scheme!r} for {modality.value} (use http, https, file or data)")
    compact = "".join(s.split())
    if len(compact) % 4 == 0 and _BASE64_RE.fullmatch(compact):
        # JPEG base64 starts with "/9j/", so a string can be both; an allowed existing file wins.
        if local_file_allowed(s, limits):
            return read_local_file(s, modality=modality, limits=limits)
        return _decode_base64(compact, cap=cap, modality=modality)
    return read_local_file(s, modality=modality, limits=limits)


def _decode_base64(text: str, *, cap: int, modality: Modality) -> bytes:
    # Each 4 base64 characters carry 3 bytes: refuse oversized payloads before decoding them.
    check_size(len(text) // 4 * 3, cap, modality, "base64 payload")
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
    check_size(len(payload), cap, modality, "data URI payload")
    return urllib.parse.unquote_to_bytes(payload)
