"""The quantization exchange format: round trips, error bounds and shard slicing."""

from __future__ import annotations

import pytest
import torch

from tessera.layers.quantization.affine import AffineWeight, quantize


@pytest.mark.parametrize("bits,group,symmetric", [(8, None, True), (8, 32, False), (4, 32, False), (4, 128, True)])
def test_round_trip_within_half_a_step(bits, group, symmetric):
    torch.manual_seed(0)
    w = torch.randn(48, 256)
    a = quantize(w, bits, group, symmetric)
    step = a.scale.repeat_interleave(a.group_size, dim=1)
    assert ((a.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    assert a.symmetric == symmetric and int(a.q.max()) < (1 << bits)
    # Quantizing what a weight dequantizes to gives back the same integers.
    assert quantize(a.dequantize(), bits, group, symmetric).q.equal(a.q)


def test_shards_slice_and_stack():
    a = quantize(torch.randn(64, 128), 4, 32)
    assert AffineWeight.cat_rows([a.rows(0, 16), a.rows(16, 48)]).dequantize().equal(a.dequantize())
    assert a.columns(32, 64).dequantize().equal(a.dequantize()[:, 32:96])
    with pytest.raises(ValueError, match="split groups"):
        a.columns(16, 32)


def test_rejects_inconsistent_parts():
    q = torch.zeros(4, 64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="group_size"):
        AffineWeight(q, torch.ones(4, 3), torch.zeros(4, 3), 4, 24)
    with pytest.raises(ValueError, match="want"):
        AffineWeight(q, torch.ones(4, 2), torch.zeros(4, 1), 4, 32)
