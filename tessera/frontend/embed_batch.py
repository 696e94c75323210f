"""Many embedding requests as one batch: Engine.encode of a list and /v1/embeddings with a list `input`.

A request alone costs the frontend a tokenizer call in a pool thread, a message to the scheduler, a ReqState
with its detokenizer and a queue it is answered through. For short texts that work, not the model, was most
of the time (256 scene captions on demo-vl: 250 ms, of which 83 ms model steps; docs/benchmarks.md,
"Embeddings"). Here the plain texts of a batch are tokenized in one tokenizer call, every tokenized request
of a replica goes in one messages.TokenizedBatchReq, and each request's answer lands straight in its place of
the batch's list (an embedding request is answered once: no stream, no detokenizer, no stop strings).

Requests with media are tokenized (loaded, preprocessed) one by one as before and each is sent as soon as it
is ready, so the scheduler encodes the first images while the frontend still preprocesses the others.

The answers are the GenerateResults TokenizerManager.generate gives; the first request that fails fails the batch
(as asyncio.gather of single requests did) and the batch's other requests are aborted.
"""

from __future__ import annotations

import asyncio
import time

from tessera import messages
from tessera.frontend.request import EngineUnavailable, GenerateRequest
from tessera.frontend.result import GenerateResult, answer_of, failure


def _plain_texts(tm, reqs: list[GenerateRequest]) -> list[int]:
    """The positions of the requests that are a text alone (no media, no media placeholders)."""
    return [i for i, r in enumerate(reqs) if r.text is not None and not tm._needs_media_processing(r)]


def _tokenize_texts(tm, reqs: list[GenerateRequest]) -> list[messages.TokenizedGenerateReq]:
    """Runs in the worker pool: one tokenizer call per add_special_tokens setting for every prompt (the fast
    tokenizer's batch call gives each text the ids its own encode would), then each request's own checks."""
    ids: list = [None] * len(reqs)
    for special in (True, False):
        where = [i for i, r in enumerate(reqs) if bool(r.add_special_tokens) is special]
        if where:
            encoded = tm.tokenizer([reqs[i].text for i in where], add_special_tokens=special)["input_ids"]
            for i, row in zip(where, encoded):
                ids[i] = list(row)
    return [tm._tokenize(r, None, row) for r, row in zip(reqs, ids)]


async def tokenize_many(tm, reqs: list[GenerateRequest], plain: list[int] | None = None
                        ) -> list[messages.TokenizedGenerateReq]:
    """tm.tokenize of every request, the plain texts among them (positions `plain`, when known) in one call;
    the first failure (in the requests' order for the texts) is raised."""
    if not tm.ready:
        raise EngineUnavailable("the engine is not ready")
    plain = _plain_texts(tm, reqs) if plain is None else plain
    for i in plain:  # (the others are checked by tm.tokenize)
        tm.check_sampling(reqs[i])
    out: list = [None] * len(reqs)
    if plain:
        texts = await asyncio.get_running_loop().run_in_executor(tm.executor, _tokenize_texts, tm,
                                                                 [reqs[i] for i in plain])
        for i, t in zip(plain, texts):
            out[i] = t
    rest = [i for i in range(len(reqs)) if out[i] is None]
    for i, t in zip(rest, await asyncio.gather(*(tm.tokenize(reqs[i]) for i in rest))):
        out[i] = t
    return out


class _Slot:
    """A batch request's entry in tm.states: the receive loop and the failure paths hand it its outputs
    through `queue.put_nowait`, as they hand a ReqState's to its queue."""

    __slots__ = ("batch", "request", "prompt_tokens", "created", "token_times", "queue")

    def __init__(self, batch: _Batch, request: GenerateRequest, prompt_tokens: int):
        self.batch, self.request, self.prompt_tokens = batch, request, prompt_tokens
        self.created = time.monotonic()
        self.token_times: list[float] = []  # no tokens; the metrics' inter-token latencies read it
        self.queue = self

    def put_nowait(self, out: messages.ReqOutput) -> None:
        self.batch.answered(self, out)


class _Batch:
    def __init__(self, tm, reqs: list[GenerateRequest]):
        self.tm, self.reqs = tm, reqs
        self.pos = {r.rid: i for i, r in enumerate(reqs)}
        self.answers: list[GenerateResult | None] = [None] * len(reqs)
        self.left = len(reqs)
        self.pending: set[str] = set()  # sent, not answered
        self.closed = False
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        if not reqs:
            self.done.set_result([])

    async def send(self, tokenized: list[messages.TokenizedGenerateReq]) -> None:
        """Routes each request (TokenizerManager.route) and sends every replica its share in one message."""
        if self.closed:
            return
        tm, shares = self.tm, {}
        for t, replica in zip(tokenized, tm.route(tokenized)):
            tm.states[t.rid] = _Slot(self, self.reqs[self.pos[t.rid]], len(t.input_ids))
            self.pending.add(t.rid)
            shares.setdefault(replica, []).append(t)
        for replica, share in shares.items():
            msg = share[0] if len(share) == 1 else messages.TokenizedBatchReq(share)
            await messages.send_async(tm.send_socks[replica], msg)

    def _leave(self, rid: str) -> None:
        self.pending.discard(rid)
        self.tm.states.pop(rid, None)
        self.tm.dispatcher.finished(rid)

    def answered(self, slot: _Slot, out: messages.ReqOutput) -> None:
        reason = out.finished_reason
        if reason is None or self.done.done():
            return  # an embedding request is answered once, with its finish
        if reason.is_error:
            self.done.set_exception(failure(reason))
            return
        rid = slot.request.rid
        self._leave(rid)
        result = answer_of(rid, out, slot.prompt_tokens, slot.created, None)
        if self.tm.on_request_done is not None:
            self.tm.on_request_done(slot, result)
        self.answers[self.pos[rid]] = result
        self.left -= 1
        if self.left == 0:
            self.done.set_result(self.answers)

    async def close(self) -> None:
        """Requests still pending (a failure, or the caller went away) are dropped here and aborted in the
        scheduler, freeing their KV."""
        self.closed = True
        for rid in list(self.pending):
            replica = self.tm.dispatcher.owner(rid)
            self._leave(rid)
            if replica is not None:
                await messages.send_async(self.tm.send_socks[replica], messages.AbortReq(rid))


async def run_batch(tm, reqs: list[GenerateRequest],
                    tokenized: list[messages.TokenizedGenerateReq] | None = None) -> list[GenerateResult]:
    """The answers of embedding requests `reqs`, in their order. tokenized: `tokenize_many(tm, reqs)` when the
    caller validated them already (the HTTP layer, before any byte is answered)."""
    batch = _Batch(tm, reqs)
    tasks: list[asyncio.Future] = []
    try:
        if tokenized is not None:
            await batch.send(tokenized)
        else:
            where = set(_plain_texts(tm, reqs))
            plain = [r for i, r in enumerate(reqs) if i in where]
            media = [r for i, r in enumerate(reqs) if i not in where]

            async def texts(part: list[GenerateRequest]) -> None:
                await batch.send(await tokenize_many(tm, part, list(range(len(part)))))

            async def one(r: GenerateRequest) -> None:
                await batch.send([await tm.tokenize(r)])

            # The texts in one part: sent a step's worth at a time (the scheduler's first step overlapping the
            # frontend's next part) they took as long on 2 cores (256 captions, 175-192 ms against 182-207).
            tasks = [asyncio.ensure_future(texts(plain))] if plain else []
            tasks += [asyncio.ensure_future(one(r)) for r in media]
            await asyncio.gather(*tasks)
        return await batch.done
    finally:
        for task in tasks:  # one failed: the others stop before they send anything more
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await batch.close()
