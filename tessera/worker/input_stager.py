"""The step's integer inputs to the device in one copy.

A step has a dozen small int64 inputs (token ids, positions, KV slots, rows, lengths, logits rows, slot-table
writes). Copied one by one from pageable memory, each is a synchronous host-to-device transfer on CUDA. The
stager packs them into one pinned host buffer and issues one non-blocking copy; the device tensors are views
of its result. On the host it only makes the tensors (no pinned memory exists without an accelerator).

The pinned buffer is reused across steps; before it is overwritten, the previous step's copy must have
left it, which an event recorded after that copy guarantees (by then the step's sampled ids were read back
anyway, so the wait is free).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tessera.platform.device import platform_of


class InputStager:
    def __init__(self, device: torch.device):
        self.device = device
        self.platform = platform_of(device)
        self.pinned = self.platform.pinned_staging
        self._host: torch.Tensor | None = None  # pinned int64 staging buffer (where the platform has them)
        self._copied = None  # an event recorded after the last copy out of _host

    def to_device(self, parts: Sequence[torch.Tensor | list[int]]) -> list[torch.Tensor]:
        """Each part (an int64 host tensor of any shape, or a list of ints) as an int64 tensor of the same
        shape on the device, all moved by one copy."""
        host = [p.to(torch.int64) if isinstance(p, torch.Tensor) else torch.tensor(p, dtype=torch.int64)
                for p in parts]
        if not self.pinned:
            return [h.to(self.device) for h in host]
        sizes = [h.numel() for h in host]
        total = max(sum(sizes), 1)
        if self._host is None or self._host.numel() < total:
            if self._copied is not None:
                self._copied.synchronize()
            self._host = torch.empty(max(total, 2 * (self._host.numel() if self._host is not None else 4096)),
                                     dtype=torch.int64, pin_memory=True)
        elif self._copied is not None:
            self._copied.synchronize()
        staged = self._host[:sum(sizes)]
        torch.cat([h.reshape(-1) for h in host], out=staged)
        flat = staged.to(self.device, non_blocking=True)
        self._copied = self.platform.new_event()
        self._copied.record()
        return [t.view(h.shape) for t, h in zip(flat.split(sizes), host)]
