"""TokenizerManager: the frontend half of the engine.

Owns the tokenizer and the multimodal processor, runs preprocessing in a worker pool (never
on the event loop), starts the scheduler process, sends it TokenizedGenerateReq messages over
ZMQ and turns the token streams it sends back into text (incrementally).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from tessera.config import ServerArgs
from tessera.frontend.detokenizer import IncrementalDetokenizer
from tessera.frontend.dispatcher import Dispatcher
from tessera.frontend.lora_registry import LoraRegistry
from tessera.frontend.model_info import ModelInfo
from tessera.frontend.prompt_checks import check_lengths, check_pooling
from tessera.frontend.preprocess_threads import preprocess_executor
from tessera.frontend.request import EngineUnavailable, FrontendStats, GenerateRequest
from tessera.frontend.result import GenerateResult, answer_of, failure
from tessera.frontend.scheduler_procs import launch_schedulers
from tessera.version import __version__ as tessera_version
from tessera import messages
from tessera.messages.worker import WorkerInfo
from tessera.models.config import ModelConfig
from tessera.models.families import refuse_media
from tessera.messages.items import Modality
from tessera.platform.launch import stop_processes

logger = logging.getLogger("tessera")
STARTUP_TIMEOUT_S = 300
PREPROCESS_THREADS = 4  # tokenization + media preprocessing threads of the frontend process
RECV_POLL_MS = 200  # how often an idle receive loop looks at the scheduler processes (a death is seen this fast)


@dataclass
class ReqState:
    request: GenerateRequest
    prompt_tokens: int
    detok: IncrementalDetokenizer
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list = field(default_factory=list)
    prompt_logprobs: messages.ReqOutput | None = None  # the output that carried the prompt's logprobs
    created: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: bool = False


class TokenizerManager:
    def __init__(self, args: ServerArgs, config: ModelConfig | None = None):
        """config: the checkpoint's, when this process has read it already."""
        self.args = args
        self.executor: ThreadPoolExecutor | None = None
        self.preprocess_pool = None  # --mm-preprocess-workers: media preprocessing in worker processes
        self._ipc_dir = tempfile.mkdtemp(prefix="tessera-ipc-")
        # One scheduler process per data-parallel replica (--dp-size); requests go where the dispatcher says.
        # They start first: their imports and model load (most of a start-up) overlap the frontend's own
        # (tokenizer, processor) on another core; start() then waits for them.
        self._procs: list[subprocess.Popen] = launch_schedulers(args, self._endpoint)
        try:
            self.info = ModelInfo.load(args, config)
            self.tokenizer = self.info.tokenizer
            self.mm_processor = self.info.make_mm_processor()
            self.executor = preprocess_executor(PREPROCESS_THREADS)
            if args.mm_preprocess_workers and self.mm_processor is not None:
                from tessera.frontend.preprocess_pool import PreprocessPool

                self.preprocess_pool = PreprocessPool(args, args.mm_preprocess_workers)
        except BaseException:
            self.shutdown()  # a model the frontend cannot read: no scheduler may outlive this error
            raise
        self.states: dict[str, ReqState] = {}
        self.send_socks: list = []
        self.dispatcher = Dispatcher(args.dp_size, args.load_balance_method)
        self.worker_infos: list[WorkerInfo] = []
        self._stats_waiters: list[asyncio.Future] = []
        self._stats_parts: dict[int, messages.SchedulerStats] = {}
        self.replica_stats: list[messages.SchedulerStats] = []
        self.ready = False
        self.context_length = self.info.context_length
        self.max_total_tokens = args.max_total_tokens or 0  # the worker's real pool size once it is ready
        self.worker_info: WorkerInfo | None = None
        self.on_request_done = None  # optional callback(state, GenerateResult) for metrics
        self.lora = LoraRegistry(args, self._send_all, lambda: sum(self.dispatcher.alive))  # adapters requests may name

    def _endpoint(self, name: str) -> str:
        return f"ipc://{os.path.join(self._ipc_dir, name)}"

    # ---- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        """Binds the sockets the scheduler processes (started in __init__) connect to and waits until each
        has loaded the model."""
        self.ctx = zmq.asyncio.Context()
        self.recv_sock = self.ctx.socket(zmq.PULL)  # every replica pushes its outputs here
        self.recv_sock.bind(self._endpoint("out"))
        ready_socks = []
        for rank in range(self.args.dp_size):
            sock = self.ctx.socket(zmq.PUSH)
            sock.bind(self._endpoint(f"in{rank}"))
            self.send_socks.append(sock)
            ready_sock = self.ctx.socket(zmq.PULL)
            ready_sock.bind(self._endpoint(f"ready{rank}"))
            ready_socks.append(ready_sock)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        for rank, (proc, ready_sock) in enumerate(zip(self._procs, ready_socks)):
            msg = None
            while msg is None:
                # Its message first: a scheduler that failed to load sends why, then exits.
                if await ready_sock.poll(200):
                    msg = await messages.recv_async(ready_sock)
                elif proc.poll() is not None:
                    raise RuntimeError(f"scheduler process {rank} exited during startup (code {proc.returncode})")
                elif time.monotonic() > deadline:
                    raise RuntimeError("scheduler did not become ready in time")
            ready_sock.close(linger=0)
            if isinstance(msg, messages.SchedulerError):
                logger.debug("scheduler %d failed to start:\n%s", rank, msg.traceback)
                raise RuntimeError(f"model failed to load: {msg.message}")
            self.worker_infos.append(msg.worker)
        self.worker_info = self.worker_infos[0]
        self.max_total_tokens = min(w.max_total_tokens for w in self.worker_infos)
        self.context_length = self.worker_info.context_length
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())
        self._recv_task.add_done_callback(self._recv_loop_ended)
        if self.preprocess_pool is not None:  # its processes loaded the processor while the model loaded
            await asyncio.get_running_loop().run_in_executor(None, self.preprocess_pool.wait_ready, STARTUP_TIMEOUT_S)
        self.ready = True

    async def close(self) -> None:
        """Stops the receive loop and closes the sockets; call on the manager's own loop."""
        task = getattr(self, "_recv_task", None)
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        for sock in [*self.send_socks, getattr(self, "recv_sock", None)]:
            if sock is not None:
                sock.close(linger=0)

    def server_info(self) -> dict:
        """SGLang's /get_server_info shape: the server arguments at the top level, with the settings they
        resolved to in the worker (device, dtype, KV pool size, context length, attention backend) in place of "auto"/None;
        the arguments as given under "server_args" and the worker's settings under "effective"."""
        given = {k: v for k, v in dataclasses.asdict(self.args).items() if k != "api_key"}
        effective = dict(dataclasses.asdict(self.worker_info) if self.worker_info else {},
                         architecture=self.info.architecture,
                         modalities=sorted(m.value for m in self.info.modalities))
        resolved = {k: effective[k] for k in ("device", "dtype", "max_total_tokens", "context_length",
                                              "attention_backend") if k in effective}
        replicas = [dict(dataclasses.asdict(w), dp_rank=i, alive=self.dispatcher.alive[i],
                         in_flight=self.dispatcher.in_flight[i]) for i, w in enumerate(self.worker_infos)]
        # What sglang-router reads to register a worker: the model's name (else it files the worker under its
        # path), the tokenizer's directory, and the capacity figures its load-aware policies use.
        router = {"served_model_name": self.args.model_name,
                  "tokenizer_path": self.args.tokenizer_path or self.args.model_path,
                  "max_req_input_len": self.context_length - 1}
        return {**given, **resolved, **router, "max_total_num_tokens": effective.get("max_total_tokens"),
                "server_args": given, "effective": effective, "replicas": replicas, "version": tessera_version,
                "lora_adapters": self.lora.cards()}

    def shutdown(self) -> None:
        self.ready = False
        stop_processes(self._procs)
        if self.executor is not None:
            self.executor.shutdown(wait=False, cancel_futures=True)
        if self.preprocess_pool is not None:
            self.preprocess_pool.shutdown()
        try:
            for name in os.listdir(self._ipc_dir):
                os.unlink(os.path.join(self._ipc_dir, name))
            os.rmdir(self._ipc_dir)
        except OSError:
            pass

    @property
    def scheduler_alive(self) -> bool:
        """Some replica is serving (a dead replica is taken out; the others go on)."""
        return any(p.poll() is None for p in self._procs)

    def _fail(self, rids: list[str], message: str) -> None:
        for rid in rids:
            state = self.states.get(rid)
            if state is not None:
                state.queue.put_nowait(messages.ReqOutput(rid, [], messages.FinishReason.error(message,
                                                                                               unavailable=True)))

    def fail_all(self, message: str) -> None:
        """Ends every request in flight with `message` (HTTP 503); the scheduler is told to drop them."""
        self._fail(list(self.states), message)

    def _check_replicas(self) -> None:
        """A replica whose scheduler died fails its requests and gets no more; the rest keep serving."""
        for rank, proc in enumerate(self._procs):
            if self.dispatcher.alive[rank] and proc.poll() is not None:
                self.dispatcher.alive[rank] = False
                logger.error("replica %d: scheduler process exited (code %s)", rank, proc.returncode)
                where = f" (data-parallel replica {rank})" if len(self._procs) > 1 else ""
                self._fail(self.dispatcher.requests_on(rank),
                           f"the scheduler process exited (code {proc.returncode}){where}")
        if not any(self.dispatcher.alive):
            self.ready = False

    def _recv_loop_ended(self, task: asyncio.Task) -> None:
        """Outputs arrive only through the receive loop: if it ever fails, say so and fail the requests in
        flight (they would otherwise wait forever) rather than keep accepting work nobody will answer."""
        if task.cancelled() or task.exception() is None:
            return
        logger.error("the receive loop failed; the engine stops serving", exc_info=task.exception())
        self.ready = False
        self._fail(list(self.states), f"internal error in the frontend: {task.exception()!r}")

    async def _recv_loop(self) -> None:
        while True:
            if not await self.recv_sock.poll(RECV_POLL_MS):
                self._check_replicas()
                # Every replica died: nobody will answer the pending requests. (Not `self.ready`: that is
                # still False while start() waits for the preprocessing pool, and the loop must outlive it.)
                if not any(self.dispatcher.alive):
                    self._fail(list(self.states), "the scheduler process exited")
                    return
                continue
            msg = await messages.recv_async(self.recv_sock)
            if isinstance(msg, messages.BatchOutput):
                for out in msg.outputs:
                    state = self.states.get(out.rid)
                    if state is not None:
                        state.queue.put_nowait(out)
            elif isinstance(msg, messages.SchedulerStats):
                self._stats_parts[msg.dp_rank] = msg
                live = [r for r, ok in enumerate(self.dispatcher.alive) if ok]
                if all(r in self._stats_parts for r in live):
                    parts, self._stats_parts = self._stats_parts, {}
                    self.replica_stats = [parts[r] for r in sorted(parts)]
                    total = messages.SchedulerStats.sum(self.replica_stats)
                    waiters, self._stats_waiters = self._stats_waiters, []
                    for fut in waiters:
                        if not fut.done():
                            fut.set_result(total)
            elif isinstance(msg, messages.LoraAdapterResult):
                self.lora.answered(msg)

    async def get_stats(self, timeout: float = 5.0) -> messages.SchedulerStats:
        """The scheduler counters summed over the live replicas (each one's in self.replica_stats)."""
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters.append(fut)
        await self._send_all(messages.GetStatsReq())
        return await asyncio.wait_for(fut, timeout)

    async def _send_all(self, msg) -> None:
        for rank, sock in enumerate(self.send_socks):
            if self.dispatcher.alive[rank]:
                await messages.send_async(sock, msg)

    def frontend_stats(self) -> FrontendStats:
        """A snapshot of the frontend counters; safe from any thread (the cache locks)."""
        if self.mm_processor is None:
            return FrontendStats()
        pool = self.preprocess_pool
        c = pool.cache_stats() if pool is not None else self.mm_processor.preprocess_cache_stats()
        return FrontendStats(c.hits, c.misses, c.used_bytes, c.num_entries)

    async def flush_cache(self) -> None:
        """Drops the preprocessing cache here and asks the scheduler to drop its caches."""
        if self.mm_processor is not None:
            self.mm_processor.preprocess_cache.clear()
        if self.preprocess_pool is not None:
            await self.preprocess_pool.clear_caches()
        await self._send_all(messages.FlushCacheReq())

    # ---- requests ---------------------------------------------------------------------------
    def _needs_media_processing(self, req: GenerateRequest) -> bool:
        return req.has_media or (self.mm_processor is not None and req.text is not None and (
            self.mm_processor.tokenizes_text or self.mm_processor.has_placeholders(req.text)))

    def check_sampling(self, req: GenerateRequest) -> None:
        """The frontend's one check of a request's sampling parameters (SamplingParams.verify, against the
        vocabulary; with return_logprob they ask for logprobs)."""
        if req.return_logprob:
            req.sampling_params.logprobs = True
        req.sampling_params.verify(self.info.vocab_size)

    def _tokenize(self, req: GenerateRequest, processed=None, ids: list[int] | None = None
                  ) -> messages.TokenizedGenerateReq:
        """Runs in the worker pool: chat-free tokenization, media loading and preprocessing (unless a
        preprocessing process already made `processed`, the ProcessorOutput, or a batched call `ids`); its
        sampling parameters were checked (check_sampling)."""
        sp = req.sampling_params
        mm_inputs = None
        given = [m for m, data in ((Modality.IMAGE, req.image_data), (Modality.VIDEO, req.video_data),
                                   (Modality.AUDIO, req.audio_data)) if data]
        if given:  # (model_name builds a Path: 1 ms over 256 texts)
            refuse_media(self.args.model_name, self.info.modalities, given, self.args.language_model_only)
        if ids is not None:  # a text alone, tokenized by a batched call (frontend/embed_batch.py)
            input_ids = ids
        elif self._needs_media_processing(req):
            if self.mm_processor is None:
                raise ValueError(self.info.no_media_reason())
            out = processed if processed is not None else self.mm_processor.process(
                prompt=req.text, input_ids=req.input_ids,
                image_data=req.image_data, video_data=req.video_data, audio_data=req.audio_data,
                video_kwargs=req.video_kwargs,
            )
            input_ids, mm_inputs = out.input_ids, out.mm_inputs
        elif req.text is not None:
            input_ids = self.tokenizer.encode(req.text, add_special_tokens=req.add_special_tokens)
        else:
            input_ids = list(req.input_ids)
            if bad := [i for i in input_ids if not 0 <= i < self.info.vocab_size]:
                raise ValueError(f"input_ids: token id {bad[0]} is outside the vocabulary (size {self.info.vocab_size})")
        check_lengths(req, input_ids, mm_inputs, self.info.config, self.context_length, self.max_total_tokens)
        req.pooling = check_pooling(req.pooling, self.info.config, self.info.is_embedding)
        lora = self.lora.resolve(req.lora_path)
        return messages.TokenizedGenerateReq(req.rid, input_ids, sp, self.lora.tag(mm_inputs, lora), req.stream,
                                             req.return_logprob, req.logprob_start_len, cache_salt=req.cache_salt,
                                             prompt_logprob_ranks=req.prompt_logprob_ranks, lora_name=lora,
                                             pooling=req.pooling)

    async def tokenize(self, req: GenerateRequest) -> messages.TokenizedGenerateReq:
        """Validates and preprocesses req (media loaded, prompt tokenized) without sending it anywhere.

        The HTTP server calls this before a streamed response starts, so every input error is a 4xx
        rather than a stream that breaks after its first byte; `generate(req, tokenized)` then runs it.
        """
        if not self.ready:
            raise EngineUnavailable("the engine is not ready")
        self.check_sampling(req)  # bad parameters fail before media is loaded
        processed = None
        if self.preprocess_pool is not None and self.mm_processor is not None and self._needs_media_processing(req):
            processed = await self.preprocess_pool.process(
                prompt=req.text, input_ids=req.input_ids,
                image_data=req.image_data, video_data=req.video_data, audio_data=req.audio_data,
                video_kwargs=req.video_kwargs)
        return await asyncio.get_running_loop().run_in_executor(self.executor, self._tokenize, req, processed)

    async def generate(self, req: GenerateRequest,
                       tokenized: messages.TokenizedGenerateReq | None = None) -> AsyncIterator[GenerateResult]:
        """Yields one final GenerateResult, or a stream of cumulative ones if req.stream.

        tokenized: the result of `tokenize(req)` when the caller validated the request already."""
        if tokenized is None:
            tokenized = await self.tokenize(req)
        sp = req.sampling_params
        state = ReqState(req, len(tokenized.input_ids), IncrementalDetokenizer(
            self.tokenizer, sp.skip_special_tokens, sp.stop, sp.spaces_between_special_tokens, sp.no_stop_trim))
        replica = self.route([tokenized])[0]
        self.states[req.rid] = state  # only now: the finally below is what removes it
        try:
            await messages.send_async(self.send_socks[replica], tokenized)
            while True:
                out: messages.ReqOutput = await state.queue.get()
                now = time.monotonic()
                if out.new_token_ids and state.first_token_time is None:
                    state.first_token_time = now
                state.token_times.extend([now] * len(out.new_token_ids))
                state.output_ids.extend(out.new_token_ids)
                if out.new_logprobs:
                    state.logprobs.extend(out.new_logprobs)
                if out.new_top_logprobs:  # SGLang's order in outputs: (logprob, token id), as output_token_logprobs
                    state.top_logprobs.extend([[(lp, tid) for tid, lp in top] for top in out.new_top_logprobs])
                if out.input_token_logprobs is not None:
                    state.prompt_logprobs = out
                finished = out.finished_reason is not None
                if finished and out.finished_reason.is_error:
                    state.finished = True
                    raise failure(out.finished_reason)
                delta = state.detok.add(out.new_token_ids, out.finished_reason)
                if finished:
                    state.finished = True
                    result = self._result(state, out, delta)
                    if self.on_request_done is not None:
                        self.on_request_done(state, result)
                    yield result
                    return
                if req.stream and (delta or req.return_logprob):
                    yield self._result(state, out, delta)
        finally:
            self.states.pop(req.rid, None)
            self.dispatcher.finished(req.rid)
            if not state.finished:  # client went away or was cancelled: free the scheduler's KV
                await messages.send_async(self.send_socks[replica], messages.AbortReq(req.rid))

    def route(self, tokenized: list[messages.TokenizedGenerateReq]) -> list[int]:
        """The replica to send each request to (counted in flight there until dispatcher.finished)."""
        self._check_replicas()  # never dispatch to a replica that has died since the last look
        if not self.ready:
            raise EngineUnavailable("the scheduler process has exited; the server is shutting down")
        out = []
        for t in tokenized:
            mm, ids = t.mm_inputs, t.input_ids
            out.append(self.dispatcher.choose(t.rid, mm.pad_input_ids(ids) if mm else ids,
                                              [item.hash for item in mm.items] if mm else []))
        return out

    def _result(self, state: ReqState, out: messages.ReqOutput, delta: str) -> GenerateResult:
        result = answer_of(state.request.rid, out, state.prompt_tokens, state.created, state.first_token_time,
                           state.detok.output_text, delta, list(state.output_ids))
        if state.request.return_logprob:
            result.output_token_logprobs = list(zip(state.logprobs, state.output_ids))
            result.output_top_logprobs = state.top_logprobs
        if (prompt := state.prompt_logprobs) is not None:
            result.input_token_logprobs = prompt.input_token_logprobs
            result.input_top_logprobs = prompt.input_top_logprobs
            result.input_token_ranks = prompt.input_token_ranks
        return result
