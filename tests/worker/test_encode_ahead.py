"""Encoding media ahead of the prefill (worker/encode_ahead.py): what the thread encodes, what a step takes,
what it holds. Through an Engine: tests/engine/test_engine_encode_ahead.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from tessera.messages.items import Modality
from tessera.worker.encode_ahead import EncodeAhead


def _item(h: int, modality: Modality = Modality.IMAGE) -> SimpleNamespace:
    return SimpleNamespace(hash=h, modality=modality)


class Tower:
    """An encode function that records its calls and the thread they ran on; `gate` holds a call until set."""

    def __init__(self, fail_on: int | None = None) -> None:
        self.calls: list[list[int]] = []
        self.threads: set[str] = set()
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.fail_on = fail_on

    def __call__(self, items: list) -> list[torch.Tensor]:
        self.started.set()
        self.gate.wait(10)
        self.calls.append([it.hash for it in items])
        self.threads.add(threading.current_thread().name)
        assert torch.is_inference_mode_enabled()
        if self.fail_on in self.calls[-1]:
            raise RuntimeError("bad item")
        return [torch.full((2, 3), float(it.hash)) for it in items]


def test_items_are_encoded_once_on_the_thread_in_calls_of_one_modality() -> None:
    tower = Tower()
    tower.gate.clear()
    ahead = EncodeAhead(tower, chunk=2, capacity=16, budget_bytes=1 << 20)
    ahead.submit([_item(1)])
    assert tower.started.wait(10)  # the first call runs alone (held at the gate)...
    ahead.submit([_item(2), _item(3, Modality.AUDIO), _item(4), _item(5), _item(2)])  # ...2 is asked twice
    assert ahead.busy and not ahead.ready(1)
    tower.gate.set()
    for h in (1, 2, 3, 4, 5):
        emb = ahead.take(h)
        assert emb is not None and float(emb[0, 0]) == h
    assert tower.calls == [[1], [2, 4], [3], [5]]  # modality kept per call, queue order otherwise
    assert tower.threads == {"tessera-encode-ahead"}
    assert ahead.take(1) is None  # taken: the step's cache has it now
    assert not ahead.busy


def test_a_queued_item_is_left_to_the_step_and_a_failed_call_gives_none() -> None:
    tower = Tower(fail_on=7)
    tower.gate.clear()
    ahead = EncodeAhead(tower, chunk=1, capacity=16, budget_bytes=1 << 20)
    ahead.submit([_item(6)])
    assert tower.started.wait(10)
    ahead.submit([_item(7), _item(8)])
    assert not ahead.ready(8)
    assert ahead.take(8) is None and ahead.ready(8)  # still queued: taken off the queue, the step encodes it
    assert ahead.take(7) is None  # the same for 7...
    tower.gate.set()
    assert float(ahead.take(6)[0, 0]) == 6
    ahead.submit([_item(7)])  # ...which, encoded ahead, fails
    while not ahead.ready(7):
        threading.Event().wait(0.01)
    assert ahead.take(7) is None  # its call raised: the step's own call will raise it
    assert tower.calls == [[6], [7]]


def test_capacity_bounds_what_is_queued_and_held() -> None:
    tower = Tower()
    ahead = EncodeAhead(tower, chunk=4, capacity=2, budget_bytes=1 << 20)
    ahead.submit([_item(1), _item(2)])
    while ahead.busy:
        threading.Event().wait(0.01)
    ahead.submit([_item(3)])  # room is made by dropping the oldest result nobody took
    while ahead.busy:
        threading.Event().wait(0.01)
    assert ahead.take(1) is None
    assert ahead.take(2) is not None and ahead.take(3) is not None
    ahead.submit([_item(9)])
    ahead.clear()  # a cache flush drops finished results
    while ahead.busy:
        threading.Event().wait(0.01)


def test_results_nobody_took_stop_new_work_at_the_byte_budget() -> None:
    tower = Tower()  # each embedding: 2 x 3 float32 = 24 bytes
    ahead = EncodeAhead(tower, chunk=4, capacity=16, budget_bytes=48)
    ahead.submit([_item(1), _item(2)])
    while ahead.busy:
        threading.Event().wait(0.01)
    ahead.submit([_item(3)])  # 48 bytes held: not queued, its step will encode it
    assert ahead.ready(3) and ahead.take(3) is None and tower.calls == [[1, 2]]
    assert ahead.take(1) is not None  # 24 bytes held now: room again
    ahead.submit([_item(3)])
    while not ahead.ready(3):
        threading.Event().wait(0.01)
    assert float(ahead.take(3)[0, 0]) == 3
    assert tower.calls == [[1, 2], [3]]


class RecordingSide:
    """A SideStream that records what ran inside its scope and which mark each result was received with."""

    def __init__(self) -> None:
        self.inside = False
        self.in_scope: list[list[int]] = []
        self.marks = 0
        self.received: list[tuple[float, int]] = []

    def scope(self):
        import contextlib

        @contextlib.contextmanager
        def cm():
            self.inside = True
            try:
                yield
            finally:
                self.inside = False
        return cm()

    def done(self) -> int:
        assert self.inside  # marked inside the scope: after the call's work, on its stream
        self.marks += 1
        return self.marks

    def receive(self, tensor: torch.Tensor, mark) -> torch.Tensor:
        self.received.append((float(tensor[0, 0]), mark))
        return tensor


def test_calls_run_in_the_side_stream_and_the_step_receives_each_result_after_its_mark() -> None:
    side = RecordingSide()

    def tower(items: list) -> list[torch.Tensor]:
        side.in_scope.append([it.hash for it in items]) if side.inside else None
        return [torch.full((2, 3), float(it.hash)) for it in items]

    gate = threading.Event()
    first = threading.Event()

    def gated(items: list) -> list[torch.Tensor]:
        first.set()
        gate.wait(10)
        return tower(items)

    ahead = EncodeAhead(gated, chunk=2, capacity=16, budget_bytes=1 << 20, side=side, host_cores=False)
    ahead.submit([_item(1)])
    assert first.wait(10)
    ahead.submit([_item(2), _item(3)])
    gate.set()
    for _ in range(1000):  # both calls done (a still-queued item would be left to the step)
        if not ahead.busy and all(ahead.ready(h) for h in (1, 2, 3)):
            break
        time.sleep(0.01)
    assert [float(ahead.take(h)[0, 0]) for h in (3, 1, 2)] == [3.0, 1.0, 2.0]
    assert side.in_scope == [[1], [2, 3]]  # every call inside the side stream's scope
    assert side.received == [(3.0, 2), (1.0, 1), (2.0, 2)]  # each result after its own call's mark


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_side_stream_results_on_cuda_equal_the_same_work_on_the_step_stream() -> None:
    """Never run on a GPU so far (none at hand when it was written)."""
    from tessera.platform.device import platform_of

    device = torch.device("cuda", torch.cuda.current_device())
    w = torch.randn(2048, 2048, device=device)

    def tower(items: list) -> list[torch.Tensor]:
        return [torch.full((64, 2048), float(it.hash), device=device) @ w for it in items]

    ahead = EncodeAhead(tower, chunk=4, capacity=16, budget_bytes=1 << 30, side=platform_of(device).side_stream(device),
                        host_cores=False)
    ahead.submit([_item(h) for h in range(1, 9)])
    while ahead.busy:
        time.sleep(0.01)
    got = [ahead.take(h) for h in range(1, 9)]
    want = tower([_item(h) for h in range(1, 9)])
    for g, x in zip(got, want):
        torch.testing.assert_close(g * 2, x * 2)  # read on the step's stream, after the side stream's event
