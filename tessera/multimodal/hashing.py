"""Content hashes of multimodal items.

Contract: `hash_item(content, kwargs)` is a 64-bit int that is equal for equal content and
equal feature-shaping kwargs, and differs (up to 2**-64 collisions) when any pixel, sample,
shape, dtype or kwarg differs. It is stable across processes and runs (blake2b, no Python
`hash()`), so it can key a shared prefix cache and encoder cache.

Every value is fed with a type tag and a length prefix, so concatenations cannot collide
(e.g. two 1-frame lists vs one 2-frame list, or bytes b"ab"+b"c" vs b"a"+b"bc").
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from PIL import Image

__all__ = ["hash_item", "kwargs_json"]


def hash_item(content: Any, kwargs: Mapping[str, Any] | None = None) -> int:
    """64-bit digest of `content` (PIL image, numpy array, torch tensor, bytes, str, number,
    None, or lists/tuples/dicts of these) and of `kwargs` as sorted JSON."""
    h = hashlib.blake2b(digest_size=8)
    _feed(h, content)
    _feed_bytes(h, b"K", kwargs_json(kwargs or {}).encode())
    return int.from_bytes(h.digest(), "little")


def kwargs_json(kwargs: Mapping[str, Any]) -> str:
    """Canonical JSON of preprocessing kwargs (sorted keys; tensors and arrays as lists)."""
    return json.dumps(kwargs, sort_keys=True, separators=(",", ":"), default=_json_default)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, Mapping):
        return dict(obj)
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=repr)
    if hasattr(obj, "__dict__"):  # e.g. transformers' SizeDict
        return {k: v for k, v in vars(obj).items() if not k.startswith("_")}
    return repr(obj)


def _feed_bytes(h: Any, tag: bytes, data: bytes | memoryview) -> None:
    h.update(tag)
    h.update(struct.pack("<Q", len(data)))
    h.update(data)


def _feed(h: Any, obj: Any) -> None:
    if isinstance(obj, Image.Image):
        _feed_bytes(h, b"I", f"{obj.mode}:{obj.width}x{obj.height}".encode())
        _feed_bytes(h, b"P", obj.tobytes())
    elif isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        _feed_bytes(h, b"T", f"{t.dtype}:{tuple(t.shape)}".encode())
        # A uint8 view works for every dtype, bfloat16 included (numpy has none).
        _feed_bytes(h, b"D", t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        if a.dtype == object:
            raise TypeError("hash_item cannot hash object arrays")
        _feed_bytes(h, b"A", f"{a.dtype.str}:{a.shape}".encode())
        _feed_bytes(h, b"D", a.tobytes())
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        _feed_bytes(h, b"B", bytes(obj))
    elif isinstance(obj, str):
        _feed_bytes(h, b"S", obj.encode())
    elif obj is None or isinstance(obj, (bool, int, float, np.generic)):
        _feed_bytes(h, b"N", repr(obj.item() if isinstance(obj, np.generic) else obj).encode())
    elif isinstance(obj, (list, tuple)):
        _feed_bytes(h, b"L", struct.pack("<Q", len(obj)))
        for x in obj:
            _feed(h, x)
    elif isinstance(obj, Mapping):
        _feed_bytes(h, b"M", struct.pack("<Q", len(obj)))
        for k in sorted(obj, key=str):
            _feed(h, str(k))
            _feed(h, obj[k])
    else:
        raise TypeError(f"hash_item cannot hash {type(obj).__name__}")
