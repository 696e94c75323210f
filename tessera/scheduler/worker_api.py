"""What the scheduler asks of the model worker of rank 0 and of the other tensor-parallel ranks: the worker and
the ranks' handle are given to the Scheduler (entrypoints/scheduler_process.py builds them), which knows them only
through these calls."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from tessera.messages.items import MultimodalDataItem
from tessera.messages.worker import ForwardInput, StepOutput, WorkerInfo


class StepWorker(Protocol):
    """What the scheduler asks of rank 0's model worker (worker/model_worker.py's ModelWorker)."""

    info: WorkerInfo
    device: torch.device
    # Called between the parts of a long step, so the CPU thread policy can re-decide (None: nothing).
    between_phases: Callable[[], object] | None

    def execute(self, fi: ForwardInput) -> StepOutput: ...

    # execute in two halves (worker/step_launch.py): the step queued, then its tokens read back. Between them
    # the overlap scheduler launches the next step (scheduler/overlap.py).
    def launch(self, fi: ForwardInput) -> object: ...

    def collect(self, handle) -> StepOutput: ...

    def flush_cache(self) -> None: ...

    def lora_adapter(self, name: str, path: str | None) -> None: ...  # load (path) or unload (None) an adapter

    def cache_stats(self) -> tuple[int, int, int]: ...

    # Encoding a request's media before its prefill, on a core of its own (worker/encode_ahead.py).
    def start_encode_ahead(self) -> bool: ...

    def encode_ahead(self, items: Sequence[MultimodalDataItem]) -> None: ...

    def media_ready(self, items: Sequence[MultimodalDataItem]) -> bool: ...

    def background_cores(self) -> int: ...

    # How long the device ran steps and sat idle between consecutive ones (platform StepClock); idle() marks
    # a pause of the scheduler (no batch), whose gap is not the device's idle time.
    def device_times(self) -> tuple[float, float]: ...

    def idle(self) -> None: ...

    # STANDALONE speculative decoding's draft model (worker/draft_model.py), or None; fakes may omit it.
    draft_proposer: object | None


class RankGroup(Protocol):
    """The other tensor-parallel ranks (distributed/tp_launch.py's TPGroupHandle)."""

    @property
    def alive(self) -> bool: ...

    def broadcast(self, msg: tuple) -> None: ...
