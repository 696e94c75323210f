"""to_device_packed: a step's inputs (and the sampler's per-row settings) keep their dtypes, shapes and bits on
the device, moved in one copy through pinned memory where the platform stages that way."""

from __future__ import annotations

import pytest
import torch

from tessera.platform.device import pack_and_copy, platform_of, to_device_packed

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])]


@pytest.mark.parametrize("device", DEVICES)
def test_parts_keep_shape_and_values(device) -> None:
    assert platform_of(device).pinned_staging == (device == "cuda")
    for step in range(3):
        n = 10 if step < 2 else 6000
        parts = [torch.arange(n) + step, torch.arange(3 * n).view(3, n), torch.tensor([step, 7, 9]),
                 torch.zeros(0, dtype=torch.int64), torch.tensor([5], dtype=torch.int32)]
        out = to_device_packed(parts, device)
        assert [t.device.type for t in out] == [device] * 5
        assert [t.dtype for t in out] == [p.dtype for p in parts]
        assert [tuple(t.shape) for t in out] == [(n,), (3, n), (3,), (0,), (1,)]
        assert all(torch.equal(t.cpu(), p) for t, p in zip(out, parts))


def test_packed_copy_gives_the_same_bits_as_views_of_one_buffer() -> None:
    """The pinned path's packing (here into an unpinned buffer, copied to the CPU): every part comes back with its
    dtype, shape and bits, whatever the order of element sizes, as a view of one tensor."""
    parts = [torch.tensor([True, False, True]), torch.tensor([[0.1, -2.5e-8, 3.0], [7.0, 1e30, -0.0]]),
             torch.tensor([5, -(2**40), 2**62]), torch.tensor([], dtype=torch.float32),
             torch.arange(6, dtype=torch.int32).view(3, 2).t()]  # a non-contiguous one
    out = pack_and_copy(parts, torch.device("cpu"), pin=False)
    for got, want in zip(out, parts):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8))  # bits
    assert len({t.untyped_storage().data_ptr() for t in out}) == 1


def test_step_clock_counts_gaps_between_consecutive_steps_only() -> None:
    import time

    from tessera.platform.device import StepClock

    clock = StepClock()
    for _ in range(2):
        clock.begin()
        time.sleep(0.02)
        clock.end()
        time.sleep(0.01)  # host work between steps: the device's idle time
    busy, idle = clock.times()
    assert 0.035 < busy < 0.2 and 0.008 < idle < 0.05  # one gap (between the two steps)
    clock.idle()  # the scheduler had nothing to run: the pause is not the device's idle time
    time.sleep(0.05)
    clock.begin()
    clock.end()
    assert clock.times()[1] == idle


class _FakeCudaEvents:
    """torch.cuda.Event without a GPU, refusing what CUDA refuses: elapsed_time between events that were not
    both recorded, or that have not completed (an event completes when it, or one recorded after it on the
    stream, is synchronised). Times come from a clock the test advances."""

    def __init__(self) -> None:
        self.now, self.recorded, self.completed = 0.0, 0, 0
        fake = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing, "elapsed_time needs enable_timing=True"
                self.seq, self.t = None, None

            def record(self) -> None:
                fake.recorded += 1
                self.seq, self.t = fake.recorded, fake.now

            def synchronize(self) -> None:
                assert self.seq is not None, "synchronize on an event never recorded"
                fake.completed = max(fake.completed, self.seq)

            def query(self) -> bool:
                return self.seq is not None and self.seq <= fake.completed

            def elapsed_time(self, end) -> float:
                for e in (self, end):
                    if e.seq is None or e.seq > fake.completed:
                        raise RuntimeError("CUDA error: device not ready (event not recorded or not completed)")
                return (end.t - self.t) * 1e3

        self.Event = Event


def test_cuda_step_clock_reads_only_completed_events(monkeypatch) -> None:
    from tessera.platform.device import CudaStepClock

    fake = _FakeCudaEvents()
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    clock = CudaStepClock()
    for busy, gap in ((0.004, 0.002), (0.006, 0.001), (0.005, 0.0)):
        clock.begin()
        fake.now += busy
        clock.end()
        fake.completed = fake.recorded  # the step's own read-back waited for its kernels
        fake.now += gap
    assert clock.times() == pytest.approx((0.015, 0.003))
    clock.idle()  # a pause of the scheduler: the next gap is not the device's
    fake.now += 1.0
    clock.begin()
    fake.now += 0.002
    clock.end()
    fake.completed = fake.recorded
    assert clock.times() == pytest.approx((0.017, 0.003))


def test_cuda_step_clock_never_waits_for_a_step_still_running(monkeypatch) -> None:
    """Overlap scheduling queues step N+1 while step N runs: begin() must not synchronise on N's events."""
    from tessera.platform.device import CudaStepClock

    fake = _FakeCudaEvents()
    monkeypatch.setattr(torch.cuda, "Event", fake.Event)
    clock = CudaStepClock()
    for busy in (0.004, 0.006):  # two steps queued back to back, neither finished
        clock.begin()
        fake.now += busy
        clock.end()
    assert fake.completed == 0 and clock.times() == (0.0, 0.0)  # nothing read, nothing waited for
    fake.completed = fake.recorded  # the second step's read-back waited for both
    assert clock.times() == pytest.approx((0.010, 0.0))  # no gap between steps queued back to back
