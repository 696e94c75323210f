"""Scheduler counters: replicas' counters add up (per-modality payload dicts key by key), and an item's
transport bytes count exactly the tensors it carries to the scheduler."""

from __future__ import annotations

import dataclasses

import torch

from tessera.messages.items import DeferredImage, Modality, MultimodalDataItem
from tessera.messages import SchedulerStats


def _stats(**changes) -> SchedulerStats:
    zero = {f.name: 0 for f in dataclasses.fields(SchedulerStats)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return SchedulerStats(**{**zero, **changes})


def test_replica_counters_add_up_key_by_key():
    a = _stats(num_running=1, mm_transport_bytes={"image": 10, "audio": 1}, mm_deferred_items=2, dp_rank=0)
    b = _stats(num_running=2, mm_transport_bytes={"image": 5, "video": 7}, mm_eager_items=3, dp_rank=1)
    total = SchedulerStats.sum([a, b])
    assert total.mm_transport_bytes == {"image": 15, "audio": 1, "video": 7}
    assert (total.num_running, total.mm_deferred_items, total.mm_eager_items, total.dp_rank) == (3, 2, 3, -1)


def test_transport_bytes_count_features_metadata_and_deferred_pixels():
    grid = torch.tensor([[1, 4, 6]])
    eager = MultimodalDataItem(Modality.IMAGE, 1, [(0, 6)], feature=torch.zeros(24, 1176),
                               model_specific_data={"image_grid_thw": grid})
    assert eager.transport_bytes == 24 * 1176 * 4 + 3 * 8
    deferred = MultimodalDataItem(Modality.IMAGE, 1, [(0, 6)], model_specific_data={"image_grid_thw": grid},
                                  deferred=DeferredImage(torch.zeros(3, 50, 80, dtype=torch.uint8), {}))
    assert deferred.transport_bytes == 3 * 50 * 80 + 3 * 8
