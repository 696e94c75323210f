"""A worker binds its CUDA device as the current one (replica r, TP rank t: cuda:base + t), without a GPU.

The stand-in replaces only what needs a driver (torch._C._cuda_setDevice, after torch.cuda.set_device's own
argument check has run): a device torch would refuse (`cuda` without an index) fails here as on a GPU."""

from __future__ import annotations

import pytest
import torch

from tessera.config import ServerArgs
from tessera.distributed.parallel_state import TPGroup
from tessera.worker import model_worker


class _Bound(Exception):
    pass


@pytest.mark.parametrize(("device", "base_gpu_id", "tp_rank", "tp_size", "want"), [
    ("cuda", 0, 0, 1, torch.device("cuda", 0)),
    ("auto", 0, 0, 1, torch.device("cuda", 0)),
    ("cuda:1", 0, 0, 1, torch.device("cuda", 1)),
    ("cuda", 2, 0, 1, torch.device("cuda", 2)),  # a second replica
    ("cuda", 2, 1, 2, torch.device("cuda", 3)),  # its second TP rank
])
def test_worker_sets_its_device_current(monkeypatch, device, base_gpu_id, tp_rank, tp_size, want) -> None:
    bound: list[torch.device] = []

    def set_device(index: int) -> None:  # what torch.cuda.set_device calls once it has checked its argument
        bound.append(torch.device("cuda", index))
        raise _Bound

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as if there were GPUs
    monkeypatch.setattr(model_worker, "tp_group", lambda: TPGroup(tp_rank, tp_size))
    monkeypatch.setattr(torch._C, "_cuda_setDevice", set_device)
    args = ServerArgs.for_engine("demo-vl", device=device, base_gpu_id=base_gpu_id)
    with pytest.raises(_Bound):
        model_worker.ModelWorker(args, set())
    assert bound == [want]


def test_set_device_refuses_a_device_without_an_index() -> None:
    """The check the stand-in above keeps: torch itself refuses what `bind` was once given."""
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.set_device(torch.device("cuda"))


def test_cpu_worker_binds_nothing(monkeypatch) -> None:
    def set_device(d: torch.device) -> None:
        raise AssertionError(f"set_device({d}) on a CPU worker")

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(model_worker, "load_model", _stop)
    with pytest.raises(_Bound):
        model_worker.ModelWorker(ServerArgs.for_engine("demo-vl", device="cpu"), set())


def _stop(*args, **kwargs):
    raise _Bound
