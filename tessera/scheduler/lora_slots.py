"""Which LoRA adapter sits in which of the worker's slots, and what a batch may mix.

The worker holds `--max-loras-per-batch` slots on the device and every loaded adapter on the host
(layers/lora/manager.py). This table, the scheduler's, decides: a batch's adapters each get a slot, those
already placed keep theirs, a new one takes an empty slot or the least recently used one that the batch does
not need (evicted to the host: its copy there stays), and the ForwardInput carries the copies to make. The
policy admits a request only while the running requests' distinct adapters fit the slots, so every batch
(the running requests' decodes plus admissions) fits.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

from tessera.messages import frontend as messages
from tessera.messages.worker import ForwardInput
from tessera.scheduler.batch import ScheduledBatch
from tessera.scheduler.req import Req


class LoraSlotTable:
    def __init__(self, num_slots: int, loaded: Iterable[str] = ()):
        self.loaded = set(loaded)  # the adapters the worker holds (a request naming another one is failed)
        self.names: list[str | None] = [None] * num_slots
        self.last_used = [0] * num_slots
        self._clock = itertools.count(1)

    @property
    def num_slots(self) -> int:
        return len(self.names)

    def fits(self, req: Req, running: Iterable[Req]) -> bool:
        """Whether `req` may join the running requests without their adapters outgrowing the slots."""
        if req.lora_name is None:
            return True
        used = {r.lora_name for r in running if r.lora_name is not None}
        return req.lora_name in used or len(used) < self.num_slots

    def fill(self, fi: ForwardInput, batch: ScheduledBatch) -> None:
        """Sets fi.lora_slots (per request row of fi: a speculative verify step's rows share their request's) and
        fi.lora_loads (the slot copies this step makes first)."""
        of_rid = {s.req.rid: s.req.lora_name for s in batch.reqs}
        names = [of_rid[rid] for rid in fi.rids]
        needed = list(dict.fromkeys(n for n in names if n is not None))
        if not needed:
            return
        assert len(needed) <= self.num_slots, "the policy admits only what the slots hold"
        now = next(self._clock)
        loads: list[tuple[int, str | None]] = []
        for name in needed:
            if name not in self.names:
                free = [i for i, held in enumerate(self.names) if held not in needed]
                slot = min(free, key=lambda i: (self.names[i] is not None, self.last_used[i]))
                self.names[slot] = name
                loads.append((slot, name))
            self.last_used[self.names.index(name)] = now
        fi.lora_slots = [self.names.index(n) if n is not None else -1 for n in names]
        fi.lora_loads = loads

    def forget(self, name: str) -> None:
        """An adapter unloaded: its slot is empty (the worker cleared it)."""
        self.loaded.discard(name)
        for i, held in enumerate(self.names):
            if held == name:
                self.names[i], self.last_used[i] = None, 0


def handle_lora_adapter(msg: messages.LoraAdapterReq, reqs: Iterable[Req], apply: Callable[[str, str | None], None],
                        slots: LoraSlotTable | None, dp_rank: int) -> messages.LoraAdapterResult:
    """Loads or unloads an adapter (`apply(name, path or None)`: on every rank of this replica); the answer
    names what went wrong. An adapter that requests still use (`reqs`: those in flight) is not unloaded (409).
    slots: the replica's slot table (None without --enable-lora)."""
    result = messages.LoraAdapterResult(msg.op_id, dp_rank=dp_rank)
    if msg.lora_path is None:
        users = sum(1 for r in reqs if r.lora_name == msg.lora_name)
        if users:
            result.error, result.status = f"adapter {msg.lora_name!r} is in use by {users} request(s)", 409
            return result
    try:
        apply(msg.lora_name, msg.lora_path)
    except ValueError as e:  # AdapterError and a server without --enable-lora
        result.error = str(e)
        result.status = 404 if "is not loaded" in result.error else 400
        return result
    if slots is not None:
        if msg.lora_path is None:
            slots.forget(msg.lora_name)
        else:
            slots.loaded.add(msg.lora_name)
    return result
