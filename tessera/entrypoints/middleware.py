"""The one middleware in front of every route: request id, API key, request counter, access-log line, and
the last word on unexpected exceptions (a 500 naming the request id; the traceback stays in the server log).

Pure ASGI on purpose: Starlette's BaseHTTPMiddleware runs the route in a separate task and hides the
client's disconnect from it, so a request whose client went away would keep its KV pages.
"""

from __future__ import annotations

import contextvars
import hmac
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass

from tessera.entrypoints.openai.errors import error_body
from tessera.entrypoints.playground import is_public
from tessera.frontend.result import GenerateResult

logger = logging.getLogger("tessera.access")
OPEN_PATHS = ("/health", "/metrics")  # as SGLang: probes and Prometheus scrape without the API key
QUIET_PATHS = ("/health", "/metrics")  # probed every few seconds: their access lines only at debug level
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")
API_KEY_ENV = "TESSERA_API_KEY"


def api_key_of(api_key: str | None, api_key_file: str | None) -> str | None:
    """The key requests must bear: --api-key, else the file's content (its surrounding whitespace dropped),
    else $TESSERA_API_KEY; None: no key. The last two keep it out of the process list."""
    if api_key and api_key_file:
        raise ValueError("api_key_file: give either --api-key or --api-key-file, not both")
    if api_key_file:
        try:
            with open(api_key_file, encoding="utf-8") as f:
                key = f.read().strip()
        except OSError as e:
            raise ValueError(f"api_key_file: cannot read {api_key_file}: {e.strerror}") from None
        if not key:
            raise ValueError(f"api_key_file: {api_key_file} is empty")
        return key
    return api_key or os.environ.get(API_KEY_ENV) or None


@dataclass
class RequestRecord:
    """What one HTTP request did, filled in by the engine as its generations finish (n > 1 adds up)."""

    request_id: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    generations: int = 0

    def observe(self, result: GenerateResult) -> None:
        if self.generations == 0:  # the n choices of one request share the prompt
            self.prompt_tokens, self.cached_tokens = result.prompt_tokens, result.cached_tokens
        self.output_tokens += result.completion_tokens
        if result.ttft is not None and (self.ttft is None or result.ttft < self.ttft):
            self.ttft = result.ttft
        self.generations += 1


CURRENT_REQUEST: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar("tessera_request",
                                                                                      default=None)


def observe_generation(result: GenerateResult) -> None:
    """Called by the engine when a generation finishes; credits the HTTP request it belongs to, if any."""
    record = CURRENT_REQUEST.get()
    if record is not None:
        record.observe(result)


class BodyTooLarge(Exception):
    status = 413
    public = True


class ServerMiddleware:
    def __init__(self, app, *, api_key: str | None, count=None, max_body_bytes: int | None = None):
        self.app, self.max_body = app, max_body_bytes
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.count = count  # callable(path, status) for the Prometheus request counter, or None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        rid = given if _CLIENT_ID.fullmatch(given) else uuid.uuid4().hex[:16]
        scope.setdefault("state", {})["request_id"] = rid
        record = RequestRecord(rid)
        token = CURRENT_REQUEST.set(record)
        path, method = scope.get("path", ""), scope.get("method", "")
        start = time.monotonic()
        status = 0
        done = disconnected = False

        async def send_wrapper(message) -> None:
            nonlocal status, done
            if message["type"] == "http.response.start":
                status = message["status"]
                message = dict(message, headers=[*message.get("headers", []), (b"x-request-id", rid.encode())])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                done = True
            await send(message)

        received = 0
        too_large = f"body: larger than --max-request-body-mb ({(self.max_body or 0) >> 20} MiB)"

        async def receive_wrapper():
            nonlocal disconnected, received
            message = await receive()
            if message["type"] == "http.disconnect" and not done:
                disconnected = True
            elif message["type"] == "http.request" and self.max_body is not None:
                received += len(message.get("body", b""))
                if received > self.max_body:  # a chunked body that declared no length
                    raise BodyTooLarge(too_large)
            return message

        try:
            if self.expected and not (path.startswith(OPEN_PATHS) or is_public(path)) and method != "OPTIONS":
                # Constant time: how long the comparison takes says nothing about how much of the key matched.
                given_key = headers.get(b"authorization", b"")
                if not hmac.compare_digest(given_key, self.expected):
                    why = ("invalid API key" if given_key else
                           "missing API key: send the header 'Authorization: Bearer <key>'")
                    await _send_json(send_wrapper, error_body(why, 401), 401)
                    return
            declared = headers.get(b"content-length", b"")
            if self.max_body is not None and declared.isdigit() and int(declared) > self.max_body:
                await _send_json(send_wrapper, error_body(too_large, 413), 413)
                return
            try:
                await self.app(scope, receive_wrapper, send_wrapper)
            except Exception as e:  # noqa: BLE001 - the last word on anything a route did not turn into a 4xx
                exc_status = getattr(e, "status", None)
                if isinstance(exc_status, int) and 400 <= exc_status < 600 and getattr(e, "public", False):
                    message, code = str(e), exc_status
                    logger.warning("request %s failed: %s", rid, e)
                else:
                    message, code = f"internal server error (request id {rid}; details in the server log)", 500
                    logger.exception("request %s: unhandled error", rid)
                if status == 0:
                    await _send_json(send_wrapper, error_body(message, code), code)
                # else: the response has begun; closing it here is the only honest signal left
        finally:
            CURRENT_REQUEST.reset(token)
            if self.count is not None and path.startswith(("/v1/", "/generate")):
                self.count(path, status or 500)
            _log_access(method, path, status, record, time.monotonic() - start, disconnected and not done)


async def _send_json(send, body: bytes, status: int) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _log_access(method: str, path: str, status: int, r: RequestRecord, latency: float, disconnected: bool) -> None:
    # The server's own warm-up requests (entrypoints/warmup.py) are not users' traffic.
    quiet = path.startswith(QUIET_PATHS) or r.request_id.startswith("warmup-")
    level = logging.DEBUG if quiet else logging.INFO
    if not logger.isEnabledFor(level):
        return
    tokens = ""
    if r.generations:
        ttft = f"{r.ttft * 1000:.0f}ms" if r.ttft is not None else "-"
        tokens = (f" prompt_tokens={r.prompt_tokens} cached_tokens={r.cached_tokens} "
                  f"output_tokens={r.output_tokens} ttft={ttft}")
    end = " client_disconnected" if disconnected else ""
    logger.log(level, "%s %s %s%s latency=%.0fms request_id=%s%s", method, path, status or "-", tokens,
               latency * 1000, r.request_id, end)
