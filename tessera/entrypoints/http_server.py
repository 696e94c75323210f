"""The HTTP server: FastAPI + uvicorn, OpenAI-compatible endpoints and SGLang's native /generate.

The model loads in the background after the socket is open, so /health answers 503 until the
scheduler is ready. Preprocessing runs in the TokenizerManager's worker pool, never on this loop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tessera.version import __version__ as tessera_version
from tessera.config import ServerArgs
from tessera.entrypoints import native_generate
from tessera.entrypoints.metrics import Metrics
from tessera.entrypoints.middleware import ServerMiddleware, api_key_of, observe_generation
from tessera.entrypoints.openai import tokenization
from tessera.entrypoints.openai.chat import create_chat_completion
from tessera.entrypoints.openai.completions import create_completion
from tessera.entrypoints.openai.embeddings import create_embedding
from tessera.entrypoints.openai.errors import APIError, error_response, param_of
from tessera.entrypoints.openai.reasoning import check_reasoning_parser
from tessera.entrypoints.openai.request_models import parse_json_body, route_docs
from tessera.entrypoints.openai.responses import create_response, get_response
from tessera.entrypoints.openai.tool_parsers import check_tool_call_parser
from tessera.entrypoints.openai.serving import ClientDisconnected, OpenAIServing
from tessera.entrypoints.warmup import WarmupError, warm_up
from tessera.entrypoints.openai.transcriptions import TranscriptionServing
from tessera.entrypoints.lora_routes import adapter_cards, add_lora_routes
from tessera.entrypoints.playground import add_playground_routes
from tessera.entrypoints.router_routes import add_router_routes
from tessera.frontend.request import GenerateRequest
from tessera.frontend.tokenizer_manager import TokenizerManager
from tessera.messages.sampling import SamplingParams
from tessera.models.config import ModelConfig

logger = logging.getLogger("tessera.server")
WATCH_INTERVAL_S = 0.1
DRAIN_TIMEOUT_S = 15.0  # SIGTERM: in-flight requests get this long to finish; uvicorn waits 5 s more (exit < 30 s)


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

    def _request_done(self, req_state, result: dict) -> None:
        self.metrics.observe_request(req_state, result)
        observe_generation(result["meta_info"])

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


class _Server(uvicorn.Server):
    """uvicorn's server with one shutdown path. The first SIGINT/SIGTERM stops accepting and drains (uvicorn's
    own); a second ends the requests in flight cleanly (ServerState.end_in_flight) instead of uvicorn's forced
    exit, which cut connections mid-response (a plain-text 500, a stream without [DONE], tracebacks). The
    signals are not raised again once the server has stopped (uvicorn does, to exit 130 after a clean drain)."""

    def __init__(self, config: uvicorn.Config, on_second_signal) -> None:
        super().__init__(config)
        self.on_second_signal = on_second_signal

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:
            self.on_second_signal()
        else:
            self.should_exit = True


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
    logger.info("KV pool: %d tokens (%.1f MiB, %d B/token)%s; context length %d; max running requests %d; "
                "chunked prefill %d tokens; page size %d; radix cache %s; CUDA graphs: not used",
                w.max_total_tokens, kv_bytes / 2**20, w.kv_bytes_per_token, replicas, w.context_length,
                args.max_running_requests, args.chunked_prefill_size, args.page_size,
                "off" if args.disable_radix_cache else "on")


def create_app(args: ServerArgs, config: ModelConfig | None = None) -> FastAPI:
    state = ServerState(args, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # launch_server loads the model before the socket opens; an app served another way loads it here,
        # in the background (/health answers 503 until it is ready).
        load_task = asyncio.create_task(state.load()) if state.tm is None and state.load_error is None else None
        yield
        if load_task is not None:
            load_task.cancel()
        await state.close()

    app = FastAPI(title="Tessera", lifespan=lifespan)
    app.state.tessera = state

    api_key = api_key_of(args.api_key, args.api_key_file)
    app.add_middleware(ServerMiddleware, api_key=api_key, max_body_bytes=args.max_request_body_mb << 20,
                       count=lambda path, status: state.metrics.requests.labels(args.model_name, path,
                                                                                str(status)).inc())

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):  # unknown routes: OpenAI's shape too
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(message, exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnected)
    async def _client_gone(request: Request, exc: ClientDisconnected):
        return Response(status_code=499)  # nginx's "client closed request": only the access log sees it

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.message, exc.status, exc.param, exc.type, headers=exc.headers)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError):
        status = getattr(exc, "status", 400)
        return error_response(str(exc), status, param_of(str(exc)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return error_response(f"invalid request: {exc.errors()}", 400)

    async def body_of(request: Request, path: str):
        """The JSON body of `path`'s route, parsed once into its model (request_models.REQUEST_BODIES)."""
        return parse_json_body(path, await request.body(), request.headers.get("content-type", ""))

    def not_ready_reason() -> str:
        if state.load_error:
            return "the model failed to load (see the server log)"
        if state.draining:
            return "the server is shutting down"
        if state.tm is not None and state.tm.worker_info is not None and not state.tm.ready:
            return "the scheduler process has exited"
        if state.ready and state.warming_up:
            return "the warm-up request is running"
        return "the model is still loading"

    def serving() -> OpenAIServing:
        if not state.ready:
            raise APIError(not_ready_reason(), status=503)
        return state.serving

    add_playground_routes(app, api_key_required=bool(api_key))
    add_lora_routes(app, serving, body_of)

    @app.get("/health")
    async def health():
        if state.ready and not state.warming_up:
            return {"status": "ok"}
        return error_response(f"not ready: {not_ready_reason()}", 503)

    def model_card() -> dict:
        # root: the model as the user named it (a served name's base), as vLLM reports it; not the resolved path
        return {"id": args.model_name, "object": "model", "created": int(state.started), "owned_by": "tessera",
                "root": args.model_name, "parent": None, "max_model_len": serving().tm.context_length}

    @app.get("/v1/models", **route_docs("/v1/models"))
    async def models():
        return {"object": "list", "data": [model_card(), *adapter_cards(serving(), int(state.started))]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        card = {c["id"]: c for c in adapter_cards(serving(), int(state.started))}.get(model_id) or model_card()
        if model_id != card["id"]:
            raise APIError(f"model: the model {model_id!r} does not exist; this server serves {card['id']!r}",
                           status=404, param="model")
        return card

    @app.get("/version")
    async def version():
        return {"version": tessera_version}

    @app.post("/tokenize", **route_docs("/tokenize"))
    async def tokenize(request: Request):
        return tokenization.tokenize(serving(), await body_of(request, "/tokenize"))

    @app.post("/detokenize", **route_docs("/detokenize"))
    async def detokenize(request: Request):
        return tokenization.detokenize(serving(), await body_of(request, "/detokenize"))

    @app.get("/health_generate")
    async def health_generate():
        """SGLang's deep health check: one token through the whole pipeline."""
        srv = serving()
        req = GenerateRequest(text="ping", sampling_params=SamplingParams(max_new_tokens=1, temperature=0))
        async for _ in srv.tm.generate(req):
            pass
        return {"status": "ok"}

    @app.get("/get_model_info")  # SGLang's older name of /model_info
    @app.get("/model_info")
    async def model_info():
        info = serving().tm.info
        return {"model_path": args.model_path, "served_model_name": args.model_name,
                "architectures": [info.architecture], "context_length": info.context_length,
                "is_generation": not info.is_embedding,
                "has_image_understanding": info.has_image_understanding,
                "has_video_understanding": info.has_video_understanding,
                "has_audio_understanding": info.has_audio_understanding}

    @app.get("/metrics")
    async def metrics():
        if not args.enable_metrics:
            return error_response("metrics are disabled; start the server with --enable-metrics", 404)
        stats = None
        if state.ready:
            try:
                stats = await state.tm.get_stats(timeout=2.0)
            except asyncio.TimeoutError:
                stats = None
        frontend = state.tm.frontend_stats() if state.ready else None
        replicas = state.tm.replica_stats if stats is not None and state.tm is not None else ()
        in_frontend = len(state.tm.states) if state.tm is not None else None
        return Response(state.metrics.render(stats, frontend, replicas, in_frontend), media_type="text/plain; version=0.0.4")

    add_router_routes(app, serving)

    @app.post("/v1/chat/completions", **route_docs("/v1/chat/completions"))
    async def chat(request: Request):
        return await create_chat_completion(serving(), request, await body_of(request, "/v1/chat/completions"))

    @app.post("/v1/responses", **route_docs("/v1/responses"))
    async def responses(request: Request):
        return await create_response(serving(), request, await body_of(request, "/v1/responses"))

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str):
        return get_response(response_id)

    @app.post("/v1/completions", **route_docs("/v1/completions"))
    async def completions(request: Request):
        return await create_completion(serving(), request, await body_of(request, "/v1/completions"))

    @app.post("/v1/embeddings", **route_docs("/v1/embeddings"))
    async def embeddings(request: Request):
        return await create_embedding(serving(), request, await body_of(request, "/v1/embeddings"))

    @app.post("/v1/audio/transcriptions", **route_docs("/v1/audio/transcriptions"))
    async def transcriptions(request: Request):
        serving()  # 503 until the model is loaded
        assert state.transcriptions is not None  # set together with state.serving
        return await state.transcriptions.create(request)

    @app.post("/v1/audio/translations", **route_docs("/v1/audio/translations"))
    async def translations(request: Request):
        serving()
        assert state.transcriptions is not None
        return await state.transcriptions.create(request, task="translate")

    @app.post("/generate", **route_docs("/generate"))
    async def generate(request: Request):
        return await native_generate.generate(serving(), request, await body_of(request, "/generate"))

    return app


def launch_server(args: ServerArgs) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s %(name)s] %(message)s")
    if args.log_level.lower() != "debug":
        # One "listening" line, ours, once the warm-up has passed: uvicorn's startup lines ("Uvicorn running on
        # ... (Press CTRL+C to quit)") come before the model is warm (its level is set in _serve), and httpx
        # logs each warm-up request.
        logging.getLogger("httpx").setLevel(logging.WARNING)
    api_key_of(args.api_key, args.api_key_file)  # an unreadable key file is a one-line error before the model loads
    check_reasoning_parser(args.reasoning_parser)
    check_tool_call_parser(args.tool_call_parser)
    config = ModelConfig.load(args.model_path, args.model_impl)  # an unsupported architecture is a one-line error now, not a 503 later
    return asyncio.run(_serve(args, config))


def check_port_free(host: str, port: int) -> None:
    """A one-line error now if the address cannot be listened on (in use, not this machine's)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ValueError(f"host: cannot listen on {host!r}: {e.strerror}") from None
    family, type_, proto, _, sockaddr = infos[0]
    with socket.socket(family, type_, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no conflict
        try:
            sock.bind(sockaddr)
        except OSError as e:
            raise ValueError(f"port: cannot listen on {host}:{port} ({e.strerror}); pick another with "
                             f"--port (PORT=N with make serve)") from None


async def _serve(args: ServerArgs, config: ModelConfig) -> int:
    """Loads the model, then opens the socket: "listening" is said only once requests can be served."""
    check_port_free(args.host, args.port)  # before minutes of loading, not after
    app = create_app(args, config)
    state: ServerState = app.state.tessera
    logger.info("loading %s (%s)", args.model_name, args.model_path)
    loop = asyncio.get_running_loop()
    load = asyncio.create_task(state.load())
    for sig in (signal.SIGINT, signal.SIGTERM):  # a signal during loading stops it (uvicorn's come later)
        loop.add_signal_handler(sig, load.cancel)
    try:
        await load
    except asyncio.CancelledError:
        logger.info("interrupted while loading the model")
        return 130
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    if state.load_error is not None:
        raise ValueError(f"model failed to load: {state.load_error}")  # the CLI prints it as one line, exit 2
    level = args.log_level.lower()
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            # our format; uvicorn's own lines only from warnings on (launch_server), but in debug
                            log_config=None, log_level=level if level not in ("info", "trace") else "warning",
                            timeout_keep_alive=5, access_log=False,  # our middleware writes the access log
                            timeout_graceful_shutdown=DRAIN_TIMEOUT_S + 5)
    server = _Server(config, lambda: loop.call_soon_threadsafe(state.end_in_flight))
    state.server = server

    async def announce() -> None:
        while not server.started and not server.should_exit:
            await asyncio.sleep(0.05)
        if server.started:
            if state.warming_up and state.tm is not None:
                try:
                    await warm_up(args, state.tm, api_key_of(args.api_key, args.api_key_file))
                except Exception as e:  # noqa: BLE001 - whatever it was, the server cannot serve: say why, stop
                    state.warmup_error = f"{type(e).__name__}: {e}" if not isinstance(e, WarmupError) else str(e)
                    logger.error("the warm-up request failed (%s); stopping", state.warmup_error)
                    server.should_exit = True
                    return
                finally:
                    state.warming_up = False
            print(f"Tessera is ready: serving {args.model_name!r}; listening on http://{args.host}:{args.port}"
                  f" (OpenAI API at /v1)", flush=True)

    state.warming_up = not args.skip_server_warmup  # from the first request on: /health waits for it
    tasks = [asyncio.create_task(announce()), asyncio.create_task(state.watch())]
    try:
        # uvicorn handles SIGINT/SIGTERM: it stops accepting, waits for the in-flight requests (which
        # state.watch drains), runs the lifespan's shutdown (which stops the scheduler) and returns.
        await server.serve()
    finally:
        for t in tasks:
            t.cancel()
        await state.close()
    logger.info("server stopped")
    if state.scheduler_died:
        raise RuntimeError("the scheduler process exited; the server stopped")
    if state.warmup_error is not None:
        raise ValueError(f"the server could not answer its own warm-up request ({state.warmup_error}); check the "
                         "flags it names (--skip-server-warmup starts without the check)")
    return 0

