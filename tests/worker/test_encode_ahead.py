"""Encoding media ahead of the prefill (worker/encode_ahead.py): what the thread encodes, what a step takes,
what it holds. Through an Engine: tests/engine/test_engine_encode_ahead.py."""

from __future__ import annotations

import threading
from types import SimpleNamespace

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
