"""The message codec: tensors of every size and dtype come back equal; small ones travel inside the pickle
(no frame of their own), large ones as out-of-band frames."""

from __future__ import annotations

import torch

from tessera import messages
from tessera.messages.codec import INBAND_MAX_BYTES


def test_tensors_round_trip_and_small_ones_stay_in_band():
    small = [torch.randn(256), torch.arange(5), torch.zeros(0), torch.ones(3, 4, dtype=torch.bool),
             torch.randn(4, 4)[:, 1]]
    large = [torch.randn(INBAND_MAX_BYTES // 4 + 1), torch.randn(2, 3, dtype=torch.bfloat16)]
    frames = messages.encode({"small": small})
    assert len(frames) == 1
    back = messages.decode(messages.encode({"small": small, "large": large}))
    for a, b in zip(small + large, back["small"] + back["large"]):
        assert b.dtype == a.dtype and torch.equal(a, b)
    back["small"][0][0] = 1.0  # writable, as torch.from_numpy of a frame is
    assert len(messages.encode(large[:1])) == 2
