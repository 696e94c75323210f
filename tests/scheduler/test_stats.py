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


def test_speculative_acceptance_and_prefix_cache_add_up_and_reach_metrics():
    from prometheus_client.parser import text_string_to_metric_families

    from tessera.entrypoints.metrics import Metrics

    total = SchedulerStats.sum([_stats(spec_verifies=4, spec_draft_tokens=16, spec_accepted_tokens=8,
                                       prefix_hit_tokens=30, prefix_total_tokens=100, state_snapshots=2),
                                _stats(spec_verifies=6, spec_draft_tokens=4, spec_accepted_tokens=4,
                                       prefix_total_tokens=20, state_snapshots=1)])
    assert (total.spec_accept_length, total.spec_accept_rate) == (1 + 12 / 10, 12 / 20)
    assert total.report()["spec_accept_length"] == 2.2 and _stats().report()["spec_accept_rate"] == 0.0
    values = {s.name: s.value for f in text_string_to_metric_families(Metrics("m").render(total).decode())
              for s in f.samples}
    assert values["tessera_spec_accept_length"] == 2.2 and values["tessera_spec_accept_rate"] == 0.6
    assert values["tessera_spec_verify_steps"] == 10
    # The prefix cache's hit rate over the replicas, and the hybrid models' state snapshots it holds.
    assert values["tessera_prefix_cache_hit_rate"] == 0.25 and values["tessera_radix_cache_state_snapshots"] == 3
