"""A worker binds its CUDA device as the current one (replica r, TP rank t: cuda:base + t), without a GPU:
the worker is stopped at torch.cuda.set_device, whose argument is recorded."""

from __future__ import annotations

import pytest
import torch

from tessera.config import ServerArgs
from tessera.distributed.parallel_state import TPGroup
from tessera.worker import model_worker


class _Bound(Exception):
    pass


@pytest.mark.parametrize(("device", "base_gpu_id", "tp_rank", "tp_size", "want"), [
    ("cuda", 0, 0, 1, torch.device("cuda")),
    ("cuda:1", 0, 0, 1, torch.device("cuda", 1)),
    ("cuda", 2, 0, 1, torch.device("cuda", 2)),  # a second replica
    ("cuda", 2, 1, 2, torch.device("cuda", 3)),  # its second TP rank
])
def test_worker_sets_its_device_current(monkeypatch, device, base_gpu_id, tp_rank, tp_size, want) -> None:
    bound: list[torch.device] = []

    def set_device(d: torch.device) -> None:
        bound.append(d)
        raise _Bound

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as if there were GPUs
    monkeypatch.setattr(model_worker, "tp_group", lambda: TPGroup(tp_rank, tp_size))
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    args = ServerArgs.for_engine("demo-vl", device=device, base_gpu_id=base_gpu_id)
    with pytest.raises(_Bound):
        model_worker.ModelWorker(args, set())
    assert bound == [want]


def test_cpu_worker_binds_nothing(monkeypatch) -> None:
    def set_device(d: torch.device) -> None:
        raise AssertionError(f"set_device({d}) on a CPU worker")

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(model_worker, "load_model", _stop)
    with pytest.raises(_Bound):
        model_worker.ModelWorker(ServerArgs.for_engine("demo-vl", device="cpu"), set())


def _stop(*args, **kwargs):
    raise _Bound
