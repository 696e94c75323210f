"""InputStager: a step's integer inputs keep their shapes and values on the device, moved in one copy
(through pinned memory on CUDA); the staging buffer is reused and grows across steps."""

from __future__ import annotations

import pytest
import torch

from tessera.worker.input_stager import InputStager

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_parts_keep_shape_and_values(device) -> None:
    stager = InputStager(torch.device(device))
    assert stager.pinned == (device == "cuda")
    for step in range(3):  # reused buffer; the last step is larger than the first allocation
        n = 10 if step < 2 else 6000
        parts = [torch.arange(n) + step, torch.arange(3 * n).view(3, n), [step, 7, 9], [], torch.tensor([5], dtype=torch.int32)]
        out = stager.to_device(parts)
        assert [t.device.type for t in out] == [device] * 5 and all(t.dtype == torch.int64 for t in out)
        assert [tuple(t.shape) for t in out] == [(n,), (3, n), (3,), (0,), (1,)]
        assert torch.equal(out[0].cpu(), parts[0]) and torch.equal(out[1].cpu(), parts[1])
        assert out[2].tolist() == [step, 7, 9] and out[4].tolist() == [5]
    if device == "cuda":
        assert stager._host is not None and stager._host.is_pinned() and stager._host.numel() >= 4 * 6000
