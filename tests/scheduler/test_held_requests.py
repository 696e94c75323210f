"""Requests the scheduler holds before its policy's queue (scheduler.py `held`): media being encoded ahead
(worker/encode_ahead.py) join when the worker says they are ready, or at once when nothing else would run;
an abort while held answers the request and leaves nothing queued."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import torch
import zmq

from tessera.messages.finish import FinishKind
from tessera import messages
from tessera.config import ServerArgs
from tessera.frontend.model_info import ModelInfo
from tessera.messages.items import Modality
from tessera.messages.sampling import SamplingParams
from tessera.messages.worker import WorkerInfo
from tessera.scheduler.scheduler import Scheduler

_ports = itertools.count()


class FakeWorker:
    """The StepWorker calls `handle` and `_admit_ready` make; `ready` is what media_ready answers."""

    def __init__(self) -> None:
        self.info = WorkerInfo(device="cpu", dtype="float32", max_total_tokens=4096, kv_bytes_per_token=64,
                               context_length=2048, vocab_size=576, attention_backend="torch_native",
                               decode_kv_mirror=False)
        self.device = torch.device("cpu")
        self.between_phases = None
        self.ready: set[int] = set()
        self.submitted: list[int] = []

    def encode_ahead(self, items) -> None:
        self.submitted += [it.hash for it in items]

    def media_ready(self, items) -> bool:
        return all(it.hash in self.ready for it in items)

    def start_encode_ahead(self) -> bool:
        return True

    def background_cores(self) -> int:
        return 0

    def cache_stats(self) -> tuple[int, int, int]:
        return 0, 0, 0

    def device_times(self) -> tuple[float, float]:
        return 0.0, 0.0

    def idle(self) -> None:
        pass


def _request(rid: str, image_hash: int) -> messages.TokenizedGenerateReq:
    item = SimpleNamespace(hash=image_hash, modality=Modality.IMAGE, transport_bytes=0, deferred=None)
    return messages.TokenizedGenerateReq(rid, [1, 2, 3], SamplingParams(max_new_tokens=2),
                                         mm_inputs=SimpleNamespace(items=[item]))


def test_media_held_until_ready_idle_admits_the_oldest_and_abort_answers() -> None:
    args = ServerArgs.for_engine("demo-vl", max_total_tokens=4096, cpu_threads=1)  # fixed threads: no policy
    config = ModelInfo.load(args).config
    ctx = zmq.Context.instance()
    n = next(_ports)
    out = ctx.socket(zmq.PULL)
    out.bind(f"inproc://held-out-{n}")
    worker = FakeWorker()
    sched = Scheduler(args, f"inproc://held-in-{n}", f"inproc://held-out-{n}", worker, config, {2})
    try:
        sched.handle(_request("a", 1))
        sched.handle(_request("b", 2))
        assert worker.submitted == [1, 2]
        # Nothing runs, so the oldest is admitted (its step encodes what the thread has not started); b waits.
        assert list(sched.held) == ["b"] and [r.rid for r in sched.policy.waiting] == ["a"]
        assert sched.stats().num_waiting == 2
        sched.handle(_request("c", 3))
        sched._admit_ready()
        assert list(sched.held) == ["b", "c"]  # a is queued now: b and c wait for their media
        worker.ready.add(3)
        sched._admit_ready()
        assert list(sched.held) == ["b"] and [r.rid for r in sched.policy.waiting] == ["a", "c"]
        sched.handle(messages.AbortReq("b"))
        assert not sched.held and "b" not in sched.reqs
        assert [r.rid for r in sched.policy.waiting] == ["a", "c"]
        assert out.poll(5000)
        (answer,) = messages.recv(out).outputs
        assert answer.rid == "b" and answer.finished_reason.kind is FinishKind.ABORT
        worker.ready.add(4)
        sched.handle(_request("d", 4))  # ready on arrival: straight to the queue
        assert not sched.held and [r.rid for r in sched.policy.waiting] == ["a", "c", "d"]
    finally:
        sched.recv_sock.close(0)
        sched.send_sock.close(0)
        out.close(0)


def test_the_loop_yields_its_steps_while_media_are_encoded_ahead() -> None:
    """poll_timeout_ms: with requests held for their media and nothing queued, a busy loop on host cores under
    the adaptive thread policy waits HELD_POLL_MS before each step (the encode-ahead thread and the frontend
    get the cores); with requests queued, a fixed thread count or nothing held it never waits; idle, it
    sleeps long unless requests are held."""
    from tessera.platform.threads import AdaptiveThreads
    from tessera.scheduler.scheduler import HELD_POLL_MS

    args = ServerArgs.for_engine("demo-vl", max_total_tokens=4096, cpu_threads=1)
    config = ModelInfo.load(args).config
    n = next(_ports)
    worker = FakeWorker()
    sched = Scheduler(args, f"inproc://held-in-{n}", f"inproc://held-out-{n}", worker, config, {2})
    try:
        assert sched.threads is None and sched.poll_timeout_ms() == 1000
        sched.handle(_request("a", 1))  # admitted at once (nothing else runs): queued, not held
        sched.handle(_request("b", 2))
        assert list(sched.held) == ["b"] and sched.policy.waiting
        assert sched.poll_timeout_ms() == 0  # a request to prefill: step at once
        running = sched.policy.waiting.popleft()
        sched.policy.running.append(running)
        assert sched.poll_timeout_ms() == 0  # a fixed thread count: the cores are the model's
        sched.threads = AdaptiveThreads(2, busy_clock=lambda: None, set_threads=lambda k: None)
        assert sched.poll_timeout_ms() == HELD_POLL_MS
        sched.handle(messages.AbortReq("b"))
        assert not sched.held and sched.poll_timeout_ms() == 0  # nothing held: decode at full speed
        sched.policy.running.remove(running)
        sched.handle(_request("c", 3))
        assert sched.policy.waiting and not sched.held  # idle again: admitted at once
        sched.policy.waiting.clear()
        worker.ready.clear()
        sched.held["d"] = (running, None)
        assert sched.poll_timeout_ms() == HELD_POLL_MS  # idle with one held: wake up to admit it
    finally:
        sched.recv_sock.close(0)
        sched.send_sock.close(0)
