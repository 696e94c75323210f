"""The HTTP server: FastAPI + uvicorn, OpenAI-compatible endpoints and SGLang's native /generate.

The model loads in the background after the socket is open, so /health answers 503 until the
scheduler is ready. Preprocessing runs in the TokenizerManager's worker pool, never on this loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response

from tessera.config import ServerArgs
from tessera.entrypoints.metrics import Metrics
from tessera.entrypoints.openai.errors import APIError, error_response, param_of
from tessera.entrypoints.openai.serving import OpenAIServing
from tessera.entrypoints.openai.transcriptions import TranscriptionServing
from tessera.frontend.tokenizer_manager import TokenizerManager

logger = logging.getLogger("tessera.server")
OPEN_PATHS = {"/health", "/metrics", "/docs", "/openapi.json"}


class ServerState:
    def __init__(self, args: ServerArgs):
        self.args = args
        self.tm: TokenizerManager | None = None
        self.serving: OpenAIServing | None = None
        self.transcriptions: TranscriptionServing | None = None
        self.metrics = Metrics(args.model_name)
        self.load_error: str | None = None
        self.server = None  # the uvicorn server, when launch_server runs one (stopped if loading fails)
        self.started = time.time()

    @property
    def ready(self) -> bool:
        return self.tm is not None and self.tm.ready and self.tm.scheduler_alive

    async def load(self) -> None:
        try:
            loop = asyncio.get_running_loop()
            tm = await loop.run_in_executor(None, TokenizerManager, self.args)
            await tm.start()
            tm.on_request_done = self.metrics.observe_request
            self.tm, self.serving = tm, OpenAIServing(tm, self.args.model_name)
            self.transcriptions = TranscriptionServing(self.serving)
            print(f"Tessera is ready: serving {self.args.model_name!r} at "
                  f"http://{self.args.host}:{self.args.port}/v1", flush=True)
        except Exception as e:
            self.load_error = str(e).removeprefix("model failed to load: ")
            logger.error("model failed to load: %s", self.load_error)
            if self.server is not None:  # nothing to serve: stop, and let `tessera serve` exit non-zero
                self.server.should_exit = True


def create_app(args: ServerArgs) -> FastAPI:
    state = ServerState(args)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        load_task = asyncio.create_task(state.load())
        yield
        load_task.cancel()
        if state.tm is not None:
            state.tm.shutdown()
            await state.tm.close()

    app = FastAPI(title="Tessera", lifespan=lifespan)
    app.state.tessera = state

    @app.middleware("http")
    async def auth_and_count(request: Request, call_next):
        if args.api_key and request.url.path not in OPEN_PATHS:
            if request.headers.get("authorization", "") != f"Bearer {args.api_key}":
                return error_response("invalid API key", 401)
        response = await call_next(request)
        if request.url.path.startswith(("/v1/", "/generate")):
            state.metrics.requests.labels(args.model_name, request.url.path, str(response.status_code)).inc()
        return response

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc.message, exc.status, exc.param, exc.type)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError):
        status = getattr(exc, "status", 400)
        return error_response(str(exc), status, param_of(str(exc)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return error_response(f"invalid request: {exc.errors()}", 400)

    async def body_of(request: Request) -> dict:
        try:
            body = json.loads(await request.body() or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"body: not valid JSON ({e})") from None
        if not isinstance(body, dict):
            raise APIError("body: expected a JSON object")
        return body

    def serving() -> OpenAIServing:
        if not state.ready:
            msg = f"model failed to load: {state.load_error}" if state.load_error else "the model is still loading"
            raise APIError(msg, status=503)
        return state.serving

    @app.get("/health")
    async def health():
        if state.ready:
            return {"status": "ok"}
        return error_response(f"not ready: {state.load_error or 'loading'}", 503)

    @app.get("/v1/models")
    async def models():
        srv = serving()
        return {"object": "list", "data": [{"id": args.model_name, "object": "model", "created": int(state.started),
                                            "owned_by": "tessera", "root": args.model_path,
                                            "max_model_len": srv.tm.context_length}]}

    @app.get("/model_info")
    async def model_info():
        info = serving().tm.info
        return {"model_path": args.model_path, "served_model_name": args.model_name,
                "architectures": [info.architecture], "context_length": info.context_length,
                "is_generation": True,
                "has_image_understanding": info.has_image_understanding,
                "has_video_understanding": info.has_video_understanding,
                "has_audio_understanding": info.has_audio_understanding}

    @app.get("/metrics")
    async def metrics():
        stats = None
        if state.ready:
            try:
                stats = await state.tm.get_stats(timeout=2.0)
            except asyncio.TimeoutError:
                stats = None
        frontend = state.tm.frontend_stats() if state.ready else None
        replicas = state.tm.replica_stats if stats is not None and state.tm is not None else ()
        return Response(state.metrics.render(stats, frontend, replicas), media_type="text/plain; version=0.0.4")

    @app.get("/get_server_info")
    async def server_info():
        tm = serving().tm
        return {**tm.server_info(), "stats": vars(await tm.get_stats())}

    @app.post("/flush_cache")
    async def flush_cache():
        await serving().tm.flush_cache()
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await serving().chat(request, await body_of(request))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving().completions(request, await body_of(request))

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request):
        serving()  # 503 until the model is loaded
        assert state.transcriptions is not None  # set together with state.serving
        return await state.transcriptions.create(request)

    @app.post("/generate")
    async def generate(request: Request):
        return await serving().generate(request, await body_of(request))

    return app


def launch_server(args: ServerArgs) -> int:
    from tessera.models.config import ModelConfig

    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s %(name)s] %(message)s")
    ModelConfig.load(args.model_path)  # an unsupported architecture is a one-line error now, not a 503 later
    app = create_app(args)
    print(f"Tessera: loading {args.model_path}; listening on http://{args.host}:{args.port}", flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                            timeout_keep_alive=5, access_log=False)
    server = uvicorn.Server(config)
    state: ServerState = app.state.tessera
    state.server = server
    # uvicorn handles SIGINT/SIGTERM: it stops accepting, finishes the lifespan (which shuts the
    # scheduler down) and returns; the scheduler also exits by itself if this process dies.
    server.run()
    if state.load_error is not None:
        raise ValueError(f"model failed to load: {state.load_error}")  # the CLI prints it as one line, exit 2
    return 0
