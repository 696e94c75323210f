"""The HTTP server's warm-up: a few short chat requests to its own port before it says it is ready.

Why: a fresh server's first requests pay one-time costs (the HF processor's and tokenizer's lazy setup, image
decoding and resizing, the frontend's preprocessing threads, oneDNN's first kernels, the encode-ahead thread's
first call, the HTTP and SSE path, malloc growing the heap). On demo-vl the first wave of 16 image requests
waited up to 700-750 ms for its first tokens against 400-600 ms in later waves; one warm-up request brought it
to 534-644 ms, four at once (one per preprocessing thread) to 387-520 (docs/benchmarks.md, "Encoding ahead").
SGLang's server warms up the same way, with requests to itself (`--skip-server-warmup` turns it off, as there).

Each request streams a few tokens for one plain PNG (320 x 240, a size the processors resize; a colour of its
own, so none is a cache hit) where the model takes images, text only otherwise. They are ordinary requests
(counted in /metrics like any other); the caches they filled are flushed afterwards.
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import time

import httpx
from PIL import Image

from tessera.config import ServerArgs
from tessera.frontend.tokenizer_manager import PREPROCESS_THREADS, TokenizerManager

logger = logging.getLogger("tessera.server")

WARMUP_TOKENS = 4
WARMUP_REQUESTS = PREPROCESS_THREADS  # at once: one per frontend preprocessing thread
WARMUP_TIMEOUT_S = 120


def local_url(host: str, port: int) -> str:
    """Where this server can reach itself: the wildcard addresses through loopback."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def warm_up(args: ServerArgs, tm: TokenizerManager, api_key: str | None) -> None:
    """Runs the warm-up requests; a failure is logged and the server serves anyway (a model whose prompts
    need more than text and images, e.g. Whisper's audio, is simply not warmed up)."""

    def body(i: int) -> dict:
        content: list[dict] = [{"type": "text", "text": "Describe the picture."}]
        if tm.info.has_image_understanding:
            png = io.BytesIO()
            Image.new("RGB", (320, 240), (64 * i, 96, 255 - 64 * i)).save(png, format="PNG")
            url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
            content.insert(0, {"type": "image_url", "image_url": {"url": url}})
        return {"model": args.model_name, "messages": [{"role": "user", "content": content}],
                "max_tokens": WARMUP_TOKENS, "temperature": 0, "stream": True}

    # No more than the running slots: a warm-up request must never wait in the queue or be refused by its cap.
    count = min(WARMUP_REQUESTS, args.max_running_requests)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    url = f"{local_url(args.host, args.port)}/v1/chat/completions"
    start = time.monotonic()
    try:
        async with httpx.AsyncClient(timeout=WARMUP_TIMEOUT_S) as client:
            async def one(i: int) -> None:
                async with client.stream("POST", url, json=body(i), headers=headers) as response:
                    if response.status_code != 200:
                        raise RuntimeError(f"HTTP {response.status_code}")
                    async for _ in response.aiter_lines():
                        pass

            await asyncio.gather(*(one(i) for i in range(count)))
        await tm.flush_cache()
    except Exception as e:  # noqa: BLE001 - a warm-up is an optimisation, never a reason not to serve
        logger.warning("warm-up requests failed (%s: %s); serving without it", type(e).__name__, e)
        return
    logger.info("warm-up requests done (%d, %s) in %.2f s", count,
                "each an image and text" if tm.info.has_image_understanding else "text", time.monotonic() - start)
