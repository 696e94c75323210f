"""Content hashes: equal for equal content + kwargs, different for any change."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from tessera.multimodal.hashing import hash_item

from .conftest import scene_frames, scene_image

KW = {"size": {"longest_edge": 50176, "shortest_edge": 3136}, "patch_size": 14}


def test_same_content_same_hash_and_range():
    img = scene_image(11)
    h = hash_item(img, KW)
    assert h == hash_item(img.copy(), dict(reversed(list(KW.items()))))  # key order does not matter
    assert h == hash_item(Image.fromarray(np.asarray(img).copy()), KW)
    assert 0 <= h < 2**64


def test_any_pixel_or_kwarg_change_changes_hash():
    img = scene_image(12)
    base = hash_item(img, KW)
    changed = img.copy()
    changed.putpixel((0, 0), tuple((c + 1) % 256 for c in img.getpixel((0, 0))))
    assert hash_item(changed, KW) != base
    assert hash_item(img, {**KW, "patch_size": 16}) != base
    assert hash_item(img, {**KW, "size": {"longest_edge": 50175, "shortest_edge": 3136}}) != base
    assert hash_item(img, None) != base
    # Same bytes, other geometry: a transposed-size image with the same buffer.
    arr = np.asarray(img)
    flat = Image.frombytes("RGB", (img.height, img.width), arr.tobytes())
    assert hash_item(flat, KW) != base


def test_videos_tensors_and_arrays():
    frames = scene_frames(13)
    h = hash_item(frames, KW)
    assert h == hash_item([f.copy() for f in frames], KW)
    assert h != hash_item(frames[:-1], KW)
    assert h != hash_item(frames[::-1], KW)
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert hash_item(t) == hash_item(t.clone())
    assert hash_item(t) != hash_item(t.reshape(4, 3))  # shape counts
    assert hash_item(t) != hash_item(t.to(torch.float64))  # dtype counts
    assert hash_item(t) != hash_item(t.numpy())  # container type counts
    assert hash_item(t.to(torch.bfloat16)) == hash_item(t.to(torch.bfloat16))
    audio = np.linspace(-1, 1, 100, dtype=np.float32)
    assert hash_item(audio, {"sampling_rate": 16000}) != hash_item(audio, {"sampling_rate": 8000})


def test_no_concatenation_collisions():
    assert hash_item([b"ab", b"c"]) != hash_item([b"a", b"bc"])
    assert hash_item([[1], [2]]) != hash_item([[1, 2]])
    assert hash_item("1") != hash_item(1) != hash_item(1.0)


@settings(max_examples=60, deadline=None, database=None)
@given(st.binary(min_size=1, max_size=64), st.integers(0, 63), st.integers(1, 255))
def test_single_byte_flip_changes_hash(data, position, delta):
    arr = np.frombuffer(data, np.uint8).copy()
    flipped = arr.copy()
    flipped[position % len(arr)] ^= delta
    assert hash_item(arr, {"k": 1}) != hash_item(flipped, {"k": 1})
    assert hash_item(arr, {"k": 1}) == hash_item(arr.copy(), {"k": 1})
