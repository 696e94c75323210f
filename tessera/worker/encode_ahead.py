"""Encoding a request's media while it waits for its prefill, on a thread beside the scheduler's loop.

On host cores the scheduler's loop is one thread that runs every step, and a step that admits a request with
an image ran the vision tower inside it: on demo-vl at concurrency 16 the tower was a quarter of the loop's
time while a fifth of the machine's cores sat idle (the thread policy gives the model the cores the frontend
leaves, so one on two cores). Encoded ahead, the tower runs on that idle core from the moment a request
arrives, and the admitting step finds the embedding waiting (figures: docs/benchmarks.md, "Encoding ahead").

Contract:
- `submit` (the scheduler's thread, on arrival) queues the distinct items nobody has asked for yet; one
  thread encodes the queue in calls of up to `chunk` items of one modality, on one torch thread, under
  inference mode, with the step's own encode function (deferred images are materialised there too).
- `take` (the step) gives an item's embedding when it was encoded ahead (waiting for it while its call
  runs), or None: then the step encodes the item itself, exactly as without this class. An item still queued
  is taken off the queue (the step's own call is sooner than the queue). A call that failed here gives None
  for its items, so the step's own call raises the error where the step's batch is failed as before.
- At most `capacity` items are queued or held, and no more is queued while the results nobody has taken yet
  hold `budget_bytes` (the encoder cache's size): past either, items wait for their step. Results nobody took
  (a request aborted before its prefill) are dropped oldest first when room is needed.
- `busy` says whether the thread has work: the thread policy then leaves it a core (platform/threads.py).
- On a GPU the thread's calls run on a stream of their own (platform/device.py SideStream), so the tower's
  kernels run while the decode steps' run; `take` orders the step's stream after the call that made the
  embedding. There the thread keeps torch's thread count (its host work is launching kernels).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch

from tessera.messages.items import MultimodalDataItem
from tessera.platform.device import SideStream
from tessera.platform.threads import one_torch_thread

logger = logging.getLogger("tessera.worker")

Encode = Callable[[list[MultimodalDataItem]], list[torch.Tensor]]


class EncodeAhead:
    def __init__(self, encode: Encode, chunk: int, capacity: int, budget_bytes: int, side: SideStream | None = None,
                 host_cores: bool = True):
        self._encode, self._chunk, self._capacity, self._budget = encode, chunk, capacity, budget_bytes
        self._side = side or SideStream()
        self._host_cores = host_cores  # the thread's torch ops run on the host's cores: one intra-op thread
        self._marks: dict[int, object | None] = {}  # item hash -> the side stream's mark of its call
        self._held_bytes = 0  # of the finished results nobody has taken
        self._queue: deque[MultimodalDataItem] = deque()
        self._results: OrderedDict[int, Future] = OrderedDict()  # item hash -> its embedding, in arrival order
        self._cv = threading.Condition()
        self._running = 0  # items in the call now running
        self._thread = threading.Thread(target=self._run, args=(torch.get_num_threads(),),
                                        name="tessera-encode-ahead", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        with self._cv:
            return bool(self._queue) or self._running > 0

    def submit(self, items: Sequence[MultimodalDataItem]) -> None:
        with self._cv:
            for item in items:
                if item.hash in self._results:
                    continue
                if self._held_bytes >= self._budget or (len(self._results) >= self._capacity
                                                          and not self._drop_one_done()):
                    break
                self._results[item.hash] = Future()
                self._queue.append(item)
            self._cv.notify()

    def ready(self, item_hash: int) -> bool:
        """Whether `take` would return without waiting."""
        with self._cv:
            result = self._results.get(item_hash)
        return result is None or result.done()

    def take(self, item_hash: int) -> torch.Tensor | None:
        with self._cv:
            result = self._results.get(item_hash)
            if result is None:
                return None
            if any(it.hash == item_hash for it in self._queue):  # not started: the step's own call is sooner
                self._queue = deque(it for it in self._queue if it.hash != item_hash)
                del self._results[item_hash]
                return None
        try:
            embedding = result.result()
        except Exception:  # noqa: BLE001 - the step encodes the item itself and raises there
            embedding = None
        with self._cv:
            mark = self._marks.pop(item_hash, None)
            if self._results.pop(item_hash, None) is not None and embedding is not None:
                self._held_bytes -= embedding.nbytes
        return None if embedding is None else self._side.receive(embedding, mark)

    def clear(self) -> None:
        """Drops the results nobody took (a cache flush); queued and running items finish as usual."""
        with self._cv:
            for h in [h for h, f in self._results.items() if f.done()]:
                self._forget(h)

    def _drop_one_done(self) -> bool:
        for h, f in self._results.items():
            if f.done():
                self._forget(h)
                return True
        return False

    def _forget(self, item_hash: int) -> None:
        """Drops a finished result (the caller holds the lock)."""
        result = self._results.pop(item_hash)
        self._marks.pop(item_hash, None)
        if result.exception() is None:
            self._held_bytes -= result.result().nbytes

    def _next_call(self) -> tuple[list[MultimodalDataItem], list[Future]]:
        """Up to `chunk` queued items of the first one's modality (the others keep their places)."""
        with self._cv:
            while not self._queue:
                self._cv.wait()
            first = self._queue[0]
            items = [it for it in self._queue if it.modality is first.modality][:self._chunk]
            taken = {id(it) for it in items}
            self._queue = deque(it for it in self._queue if id(it) not in taken)
            self._running = len(items)
            return items, [self._results[it.hash] for it in items]

    def _run(self, inherited_threads: int) -> None:
        if self._host_cores:
            one_torch_thread(inherited_threads)
        while True:
            items, results = self._next_call()
            try:
                with torch.inference_mode(), self._side.scope():
                    embeddings = self._encode(items)
                    mark = self._side.done()
                if len(embeddings) != len(items):
                    raise ValueError(f"{len(embeddings)} embeddings for {len(items)} items")
            except Exception as e:  # noqa: BLE001 - reported by the step's own call (see the contract)
                logger.debug("encode-ahead call over %d items failed: %s", len(items), e)
                for r in results:
                    r.set_exception(e)
            else:
                with self._cv:
                    self._held_bytes += sum(emb.nbytes for emb in embeddings)
                    for it in items:
                        self._marks[it.hash] = mark
                for r, emb in zip(results, embeddings):
                    r.set_result(emb)
            with self._cv:
                self._running = 0
