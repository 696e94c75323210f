"""Overlap scheduling (--enable-overlap-schedule, SGLang's overlap scheduler): the host forms and launches decode
step N+1 before it reads step N's tokens, so the device is not idle while the host appends tokens, checks stops,
streams outputs and forms the next step.

A decode step is launched without waiting for its tokens (`worker.launch`); the next `step()` forms the one that
follows it from what the host knows without those tokens: the same requests, one more position each, and as
input token a placeholder, -1 - (the request's row in step N), which the worker replaces on the device by step
N's sampled id (worker/step_launch.py). It launches that step, then collects and processes step N as the plain
loop would. A request that step N finishes (a stop token or string, found only now) rides step N+1 for a token
that is discarded, and its KV goes back once step N+1 has been collected, ending where it would have ended
without overlap (the rider's token is not cached). Requests that reach max_tokens or the context at step N are
known beforehand and do not ride.

Only where the result is exact: a step overlaps when every row is a plain decode row whose sampling needs
nothing but the count of its tokens from the host (no grammar, no frequency / presence / repetition penalty,
which read the tokens, no model rules over them (Whisper's), no pooling). A seeded row's generator is seeded
from that count, which the placeholder row keeps, so greedy and seeded output are token for token the same;
rows without a seed draw from the shared stream, whose draws (as with any change of the batch) depend on the
rows beside them. Anything else (an admission, a prefill chunk, speculative verify steps, an ineligible row, a
full pool) drains: step N is collected and processed, and the step runs as without overlap. Off under tensor
parallelism (ServerArgs.overlap_schedule): only rank 0 samples, so the other ranks cannot read the placeholders.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from tessera.messages.worker import ForwardInput
from tessera.models.base import TesseraModel
from tessera.scheduler.batch import ScheduledBatch, ScheduledReq
from tessera.scheduler.policy import SchedulePolicy
from tessera.scheduler.req import Req


@dataclass
class Launched:
    """A step handed to the worker whose tokens have not been processed yet."""

    batch: ScheduledBatch
    fi: ForwardInput
    handle: object
    # Requests that finished or were aborted while this step ran: (request, its KV length, slots it holds).
    deferred: list[tuple[Req, int, int]] = field(default_factory=list)

    def holds(self, req: Req) -> bool:
        return any(s.req is req for s in self.batch.reqs)


class Overlap:
    """The overlap loop of one Scheduler: its schedule policy, and its two halves of a step: `launch` (a batch,
    with placeholders for the tokens in flight, handed to the worker; None when it failed) and `finish_step`
    (a launched step's tokens read and applied)."""

    def __init__(self, policy: SchedulePolicy, launch: Callable[..., Launched | None],
                 finish_step: Callable[[Launched], None], context_length: int, model_cls: type[TesseraModel]):
        self.policy, self.launch, self.finish_step, self.context_length = policy, launch, finish_step, context_length
        self.inflight: Launched | None = None  # the last launched step, not yet processed
        # A family's own logits rules may read each row's tokens (Whisper's timestamp rules).
        self.family_ok = (model_cls.process_logits is TesseraModel.process_logits
                          and not model_cls.process_logits_reads_prompt)
        self.num_overlapped = 0  # steps launched before the previous one's tokens were read

    def step(self) -> bool:
        prev = self.inflight
        if prev is not None:
            follow = self._follow_on(prev)
            if follow is not None:
                self.inflight = self.launch(*follow)  # queued behind prev on the device
                self.num_overlapped += self.inflight is not None
                self._finish(prev)
                return True
            self.drain()
        batch = self.policy.next_batch()
        if batch is None:
            return prev is not None
        step = self.launch(batch)
        if step is not None and self._exact(batch):
            self.inflight = step  # processed by the next step(), after it launched the step that follows
        elif step is not None:
            self.finish_step(step)
        return True

    def drain(self) -> None:
        """Collects and processes the step in flight (before a step that cannot overlap, a cache flush)."""
        prev, self.inflight = self.inflight, None
        if prev is not None:
            self._finish(prev)

    def release_later(self, req: Req, finished: bool) -> bool:
        """Keeps req's KV until the step in flight that holds a row of it is collected (False: it holds none, so
        the caller releases it now). A finished request rode that step for a discarded token: its KV ends before
        that token, as without overlap; an aborted one keeps the KV of the tokens it had."""
        step = self.inflight
        if step is None or not step.holds(req):
            return False
        self.policy.running.remove(req)
        kv_len = min(req.kv_len - 1 if finished else req.kv_len, req.seq_len)
        step.deferred.append((req, kv_len, req.kv_len))
        return True

    def _finish(self, step: Launched) -> None:
        self.finish_step(step)  # rows of requests that finished meanwhile are skipped there
        for req, kv_len, held in step.deferred:
            req.kv_len = kv_len
            self.policy.kv.release(req, allocated_len=held)

    def _exact(self, batch: ScheduledBatch) -> bool:
        """Whether a step's tokens can wait: plain decode rows only, each eligible."""
        return self.family_ok and all(s.samples and not s.is_prefill and not s.draft and self._row_ok(s.req)
                                      for s in batch.reqs)

    @staticmethod
    def _row_ok(req: Req) -> bool:
        sp = req.sampling_params
        return (req.grammar is None and sp.constraint is None and req.pooling is None and sp.frequency_penalty == 0
                and sp.presence_penalty == 0 and sp.repetition_penalty == 1)

    def _follow_on(self, prev: Launched) -> tuple[ScheduledBatch, list[int]] | None:
        """The decode step after `prev` (launched, its tokens unknown), or None when the next step must see them:
        a request waits for admission, one runs that `prev` did not decode, or the pool has no slots left."""
        policy = self.policy
        if policy.waiting or not policy.running:
            return None
        rows = {id(s.req): i for i, s in enumerate(prev.batch.reqs)}
        if any(id(r) not in rows for r in policy.running):
            return None
        # Requests that prev's token ends by length finish without riding along.
        reqs = [s.req for s in prev.batch.reqs if s.req in policy.running
                and len(s.req.output_ids) + 1 < s.req.sampling_params.max_new_tokens
                and s.req.seq_len + 1 < self.context_length]
        if not reqs:
            return None
        slots = policy.kv.alloc_decode(reqs)
        if slots is None:
            return None  # the plain step evicts and retracts
        batch = ScheduledBatch([ScheduledReq(r, r.kv_len, r.kv_len + 1, slots[i:i + 1]) for i, r in enumerate(reqs)])
        for r in reqs:
            r.kv_len += 1
        return batch, [-1 - rows[id(r)] for r in reqs]
