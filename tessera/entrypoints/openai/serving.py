"""What the OpenAI endpoints share over the TokenizerManager: model check, n fan-out, tokenize-first, run.

Every request is validated and tokenized (media loaded) before its response starts (`prepare`), so input
errors are 4xx responses, never a stream that breaks after its first byte; `collect_all` aborts a
non-streaming request whose client left, `merged_stream` interleaves the choices of a streamed one. The
endpoints themselves live beside this file (chat.py, completions.py, transcriptions.py, tokenization.py,
../native_generate.py) as functions of an OpenAIServing; the SSE framing is in streaming.py.
"""

from __future__ import annotations

import asyncio
import uuid
import dataclasses
import time
from collections.abc import AsyncIterator

from fastapi import Request

from tessera.entrypoints.openai.errors import APIError
from tessera.entrypoints.openai.protocol import renamed_error
from tessera.frontend.embed_batch import run_batch, tokenize_many
from tessera.frontend.request import GenerateRequest
from tessera.frontend.result import GenerateResult
from tessera.frontend.tokenizer_manager import TokenizerManager
from tessera.messages.sampling import SamplingParams
from tessera.messages import TokenizedGenerateReq
from tessera.multimodal.media_limits import MediaError

MAX_N = 128  # choices per request, as OpenAI's API allows
MAX_BATCH = 1024  # prompts in one batched request (/v1/completions, /generate): each becomes a request
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
RETRY_AFTER_S = 1  # an overloaded server's Retry-After: about one batch of requests finishing
# A prepared generation whose response never started (its client left first) stops counting after this long.
PREPARED_TTL_S = 30.0


def check_batch(size: int, param: str) -> None:
    if size > MAX_BATCH:
        raise APIError(f"{param}: at most {MAX_BATCH} prompts in one request, got {size}", param=param)


class ClientDisconnected(Exception):
    """The client of a non-streaming request went away; its generations were aborted (nobody to answer)."""


class OpenAIServing:
    """The served model and its TokenizerManager, with the steps every endpoint takes."""

    def __init__(self, tm: TokenizerManager, model_name: str):
        self.tm, self.model_name = tm, model_name
        info = tm.info
        proc_template = getattr(info.hf_processor, "chat_template", None) if info.hf_processor is not None else None
        self.chat_template = proc_template or getattr(info.tokenizer, "chat_template", None)
        self.preparing = 0  # generations admitted and being tokenized
        # rid -> when: tokenized, their response not yet started (so not in tm.states yet). A streamed response
        # starts a few event-loop turns after its endpoint returns: uncounted, that gap let 56 generations in
        # under a cap of 48 with 192 clients (docs/benchmarks.md, issue 32).
        self.prepared: dict[str, float] = {}
        self.on_overload = None  # called for each request refused by --max-queued-requests (metrics)

    def check_model(self, name: str | None, lora_path: str | None = None) -> str | None:
        """The LoRA adapter a request runs with: `model` "base:adapter" or an adapter's own name, or SGLang's
        `lora_path` (None: the base model); 404 for a model or adapter this server does not serve."""
        try:
            adapter = self.tm.lora.model_adapter(name, (self.model_name, self.tm.args.model_path))
        except ValueError as e:
            raise APIError(str(e), status=404, param="model") from None
        return self.tm.lora.resolve(lora_path) if lora_path is not None else adapter

    def answer_model(self, adapter: str | None, requested: str | None) -> str:
        """The `model` an answer reports: the served name, or for a LoRA adapter's answer the name the request
        gave it ("base:adapter" or the adapter's own), else the adapter's."""
        if adapter is None:
            return self.model_name
        return requested if requested not in (None, "", self.model_name) else adapter

    def fan_out(self, base: dict, sp: SamplingParams) -> list[GenerateRequest]:
        # n is checked before it sizes anything: a huge n would otherwise build that many requests first.
        if isinstance(sp.n, bool) or not isinstance(sp.n, int) or not 1 <= sp.n <= MAX_N:
            raise APIError(f"n: must be an integer in [1, {MAX_N}], got {sp.n!r}", param="n")
        reqs = []
        for i in range(sp.n):
            # A seed that is not an int is left for SamplingParams' check to refuse (a 400 naming it), not added to.
            seed = sp.seed + i if isinstance(sp.seed, int) and not isinstance(sp.seed, bool) else sp.seed
            params = dataclasses.replace(sp, n=1, seed=seed)  # fields only: not the verification memo
            reqs.append(GenerateRequest(sampling_params=params, **base))
        return reqs

    async def prepare(self, reqs: list[GenerateRequest], names: dict[str, str], batched: bool = False,
                      media_param: str | None = None) -> list[TokenizedGenerateReq]:
        """Validates and tokenizes every request before anything is sent (or any byte answered). batched:
        embedding requests, their texts tokenized in one call (frontend/embed_batch.py). media_param: the field
        a media error names (the request's media came in it: chat's "messages", /generate's "image_data")."""
        self._admit(len(reqs))
        self.preparing += len(reqs)
        try:
            if batched:
                tokenized = await tokenize_many(self.tm, reqs)
            else:
                tokenized = list(await asyncio.gather(*(self.tm.tokenize(r) for r in reqs)))
        except ValueError as e:
            err = renamed_error(e, names)
            if err.param is None and isinstance(e, MediaError):
                err.param = media_param
            raise err from None
        finally:
            self.preparing -= len(reqs)
        now = time.monotonic()
        self.prepared.update((r.rid, now) for r in reqs)
        return tokenized

    def _generate(self, r: GenerateRequest, t: TokenizedGenerateReq) -> AsyncIterator[GenerateResult]:
        """tm.generate of a prepared request: it leaves `prepared` in the same event-loop step as generate's
        first iteration puts it in tm.states (no await between), so it is counted once throughout."""
        self.prepared.pop(r.rid, None)
        return self.tm.generate(r, t)

    def _admit(self, n: int) -> None:
        """--max-queued-requests (SGLang's): beyond the running slots of every replica, at most that many
        generations wait; a request that would make more wait is refused before any work (503, Retry-After).
        Counted in the frontend (generations sent and not finished, those being tokenized and those tokenized
        whose response has not started yet), so what is admitted is never slowed by the check."""
        args = self.tm.args
        if args.max_queued_requests is None:
            return
        stale = time.monotonic() - PREPARED_TTL_S
        for rid in [rid for rid, at in self.prepared.items() if at < stale]:
            del self.prepared[rid]
        waiting = len(self.tm.states) + self.preparing + len(self.prepared) - args.max_running_requests * args.dp_size
        if waiting + n > args.max_queued_requests:
            if self.on_overload is not None:
                self.on_overload()
            raise APIError(f"server overloaded: {max(waiting, 0)} generations are waiting (--max-queued-requests "
                           f"{args.max_queued_requests}); retry later", status=503,
                           headers={"Retry-After": str(RETRY_AFTER_S)})

    async def collect_all(self, request: Request, reqs: list[GenerateRequest],
                          tokenized: list[TokenizedGenerateReq], batched: bool = False) -> list[GenerateResult]:
        """Runs the requests to completion; aborts them all if the client disconnects. batched: embedding
        requests, sent and answered as one batch (frontend/embed_batch.py)."""

        async def one(r: GenerateRequest, t: TokenizedGenerateReq) -> GenerateResult:
            out = None
            async for out in self._generate(r, t):
                pass
            return out

        async def batch() -> list[GenerateResult]:
            for r in reqs:  # they enter tm.states before run_batch's first await, as _generate's do
                self.prepared.pop(r.rid, None)
            return await run_batch(self.tm, reqs, tokenized)

        task = asyncio.ensure_future(batch() if batched else
                                     asyncio.gather(*(one(r, t) for r, t in zip(reqs, tokenized))))
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()  # each generate()'s finally sends AbortReq, freeing the KV
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                raise ClientDisconnected(request.url.path)

    async def _collect_all(self, request: Request, reqs: list[GenerateRequest]) -> list[GenerateResult]:
        """prepare + collect_all, for the transcription endpoints."""
        return await self.collect_all(request, reqs, await self.prepare(reqs, {}))

    async def _first_or_error(self, gen: AsyncIterator[str]) -> AsyncIterator[str]:
        """Pulls the first chunk before the response starts, so errors that come before it are 4xx
        (the transcription stream tokenizes as it goes)."""
        first = await gen.__anext__()

        async def rest() -> AsyncIterator[str]:
            yield first
            async for chunk in gen:
                yield chunk

        return rest()

    async def merged_stream(self, reqs: list[GenerateRequest],
                            tokenized: list[TokenizedGenerateReq]) -> AsyncIterator[tuple[int, GenerateResult]]:
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int, r: GenerateRequest, t: TokenizedGenerateReq) -> None:
            try:
                async for out in self._generate(r, t):
                    await queue.put((i, out))
            except Exception as e:  # surfaces to the consumer
                await queue.put((i, e))
            finally:
                await queue.put((i, done))

        tasks = [asyncio.ensure_future(pump(i, r, t)) for i, (r, t) in enumerate(zip(reqs, tokenized))]
        remaining = len(tasks)
        try:
            while remaining:
                i, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()

    def token_text(self, token_id: int) -> str:
        return self.tm.tokenizer.decode([token_id])


def response_id(prefix: str, request) -> str:
    """The response's `id`: the prefix and the request id the server answers in the x-request-id header (the
    client's own when it sent one), so a client can match a response with the server's log line."""
    rid = (request.scope.get("state") or {}).get("request_id")
    return f"{prefix}-{rid or uuid.uuid4().hex}"

