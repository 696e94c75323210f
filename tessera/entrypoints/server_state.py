"""ServerState: what the HTTP server's routes share (the TokenizerManager once loaded, the OpenAI serving
layer, the metrics, readiness and drain flags), with the one check every model route makes first
(`serving_or_503`: a 503 naming why until the model is loaded) and the one body parser (`body_of`)."""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import Request

from tessera.config import ServerArgs
from tessera.entrypoints.metrics import Metrics
from tessera.entrypoints.middleware import observe_generation
from tessera.entrypoints.openai.errors import APIError
from tessera.entrypoints.openai.request_models import parse_json_body
from tessera.entrypoints.openai.serving import OpenAIServing
from tessera.entrypoints.openai.transcriptions import TranscriptionServing
from tessera.frontend.result import GenerateResult
from tessera.frontend.tokenizer_manager import TokenizerManager
from tessera.models.config import ModelConfig

logger = logging.getLogger("tessera.server")
WATCH_INTERVAL_S = 0.1
DRAIN_TIMEOUT_S = 15.0  # SIGTERM: in-flight requests get this long to finish; uvicorn waits 5 s more (exit < 30 s)


async def body_of(request: Request, path: str):
    """The JSON body of `path`'s route, parsed once into its model (request_models.REQUEST_BODIES)."""
    return parse_json_body(path, await request.body(), request.headers.get("content-type", ""))


class ServerState:
    def __init__(self, args: ServerArgs, config: ModelConfig | None = None):
        self.args = args
        self.config = config  # the checkpoint's, when launch_server has read it (the frontend reads it once)
        self.tm: TokenizerManager | None = None
        self.serving: OpenAIServing | None = None
        self.transcriptions: TranscriptionServing | None = None
        self.metrics = Metrics(args.model_name)
        self.load_error: str | None = None
        self.scheduler_died = False  # every scheduler process exited while serving: the server stops, exit 1
        self.draining = False  # SIGTERM: no new requests, in-flight ones finish (or end cleanly at the deadline)
        self.server = None  # the uvicorn server, when launch_server runs one
        self.warming_up = False  # the warm-up request is running: /health says 503 until it is done (as SGLang)
        self.warmup_error: str | None = None  # it failed: the server stops instead of serving
        self.started = time.time()

    @property
    def ready(self) -> bool:
        return self.tm is not None and self.tm.ready and self.tm.scheduler_alive and not self.draining

    def not_ready_reason(self) -> str:
        if self.load_error:
            return "the model failed to load (see the server log)"
        if self.draining:
            return "the server is shutting down"
        if self.tm is not None and self.tm.worker_info is not None and not self.tm.ready:
            return "the scheduler process has exited"
        if self.ready and self.warming_up:
            return "the warm-up request is running"
        return "the model is still loading"

    def serving_or_503(self) -> OpenAIServing:
        """The serving layer of the loaded model; an APIError 503 naming why not while there is none."""
        if not self.ready:
            raise APIError(self.not_ready_reason(), status=503)
        assert self.serving is not None  # ready: set together with tm
        return self.serving

    def _request_done(self, req_state, result: GenerateResult) -> None:
        self.metrics.observe_request(req_state, result)
        observe_generation(result)

    async def load(self) -> None:
        tm = None
        try:
            loop = asyncio.get_running_loop()
            tm = await loop.run_in_executor(None, TokenizerManager, self.args, self.config)
            await tm.start()
            tm.on_request_done = self._request_done
            self.tm, self.serving = tm, OpenAIServing(tm, self.args.model_name)
            self.serving.on_overload = self.metrics.rejected.labels(self.args.model_name).inc
            self.transcriptions = TranscriptionServing(self.serving)
            log_startup_summary(self.args, tm)
        except BaseException as e:
            if tm is not None:  # a half-started manager: its scheduler processes must not outlive us
                tm.shutdown()
                await tm.close()
            if not isinstance(e, Exception):
                raise
            self.load_error = str(e).removeprefix("model failed to load: ")
            logger.debug("model failed to load", exc_info=True)
            if self.server is not None:  # nothing to serve: stop, and let `tessera serve` exit non-zero
                self.server.should_exit = True

    async def close(self) -> None:
        if self.tm is not None:
            self.tm.shutdown()
            await self.tm.close()

    async def watch(self) -> None:
        """While serving: a scheduler that died stops the server (its requests have had their 503s); a
        SIGTERM starts the drain, which ends what is still running after DRAIN_TIMEOUT_S with a clean error."""
        tm, server = self.tm, self.server
        assert tm is not None and server is not None
        while not server.should_exit:
            if not tm.ready:
                logger.error("the scheduler process exited; stopping the server")
                self.scheduler_died = True
                await asyncio.sleep(0.5)  # the failed requests' 503s go out first
                server.should_exit = True
                return
            await asyncio.sleep(WATCH_INTERVAL_S)
        self.draining = True
        in_flight = len(tm.states)
        if in_flight:
            logger.info("shutting down: draining %d in-flight request(s) for up to %.0f s (interrupt again to "
                        "end them now)", in_flight, DRAIN_TIMEOUT_S)
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while tm.states and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if tm.states:
            logger.warning("shutting down: ending %d request(s) that did not finish in time", len(tm.states))
            self.end_in_flight()

    def end_in_flight(self) -> None:
        """Ends every request in flight now, each with a 503 in OpenAI's error shape (a final error event and
        [DONE] for a stream), one log line each."""
        if self.tm is None:
            return
        for rid in list(self.tm.states):
            logger.warning("request %s ended: the server is shutting down", rid)
        self.tm.fail_all("the server is shutting down")


def log_startup_summary(args: ServerArgs, tm: TokenizerManager) -> None:
    """What the server settled on, once, at info level (the figures come from the loaded worker)."""
    w = tm.worker_info
    if w is None:
        return
    params = w.num_parameters
    size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    kv_bytes = w.max_total_tokens * w.kv_bytes_per_token * args.dp_size
    replicas = f" x {args.dp_size} replicas" if args.dp_size > 1 else ""
    logger.info("model %s (%s): %s parameters, dtype %s, device %s, attention %s, tp %d",
                args.model_name, tm.info.architecture, size, w.dtype, w.device, w.attention_backend, w.tp_size)
    sizes = w.cuda_graph_batch_sizes
    graphs = f"{w.cuda_graph_status} (batch sizes {sizes[0]}-{sizes[-1]})" if sizes else w.cuda_graph_status or "off"
    logger.info("KV pool: %d tokens (%.1f MiB, %d B/token)%s; context length %d; max running requests %d; "
                "chunked prefill %d tokens; page size %d; radix cache %s; CUDA graphs: %s",
                w.max_total_tokens, kv_bytes / 2**20, w.kv_bytes_per_token, replicas, w.context_length,
                args.max_running_requests, args.chunked_prefill_size, args.page_size,
                "off" if args.disable_radix_cache else "on", graphs)
