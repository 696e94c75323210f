"""The HTTP server: FastAPI + uvicorn, OpenAI-compatible endpoints and SGLang's native /generate.

The model loads in the background after the socket is open, so /health answers 503 until the
scheduler is ready. Preprocessing runs in the TokenizerManager's worker pool, never on this loop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tessera.config import ServerArgs
from tessera.entrypoints.admin_routes import admin_router
from tessera.entrypoints.lora_routes import lora_router
from tessera.entrypoints.middleware import ServerMiddleware, api_key_of
from tessera.entrypoints.native_routes import native_router
from tessera.entrypoints.openai.errors import APIError, error_response, param_of
from tessera.entrypoints.openai.reasoning import check_reasoning_parser
from tessera.entrypoints.openai.serving import ClientDisconnected
from tessera.entrypoints.openai.tool_parsers import check_tool_call_parser
from tessera.entrypoints.openai_routes import openai_router
from tessera.entrypoints.playground import playground_router
from tessera.entrypoints.server_state import DRAIN_TIMEOUT_S, ServerState
from tessera.entrypoints.warmup import WarmupError, warm_up
from tessera.models.config import ModelConfig

logger = logging.getLogger("tessera.server")


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


def create_app(args: ServerArgs, config: ModelConfig | None = None) -> FastAPI:
    """The ASGI app: the middleware, the error handlers (every error in OpenAI's shape) and one router per
    area (OpenAI, native, admin, LoRA, playground) over one ServerState."""
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

    for router in (playground_router(api_key_required=bool(api_key)), lora_router(state), admin_router(state),
                   native_router(state), openai_router(state)):
        app.include_router(router)
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

