"""The HTTP server's warm-up: one short chat request to its own port before it says it is ready.

Why: a fresh server's first requests pay one-time costs (the HF processor's and tokenizer's lazy setup, image
decoding and resizing, oneDNN's first kernels, the encode-ahead thread's first call, the HTTP and SSE path,
malloc growing the heap). On demo-vl the first wave of 16 image requests waited up to 700-750 ms for its first
tokens against 400-600 ms in later waves (docs/benchmarks.md, "Encoding ahead"). SGLang's server warms up the
same way, with a request to itself (`--skip-server-warmup` turns it off, as there).

The request streams a few tokens for one plain 320 x 240 PNG where the model takes images (a size the
processors resize), text only otherwise. It is an ordinary request (counted in /metrics like any other); the
caches it filled are flushed afterwards.
"""

from __future__ import annotations

import base64
import io
import logging
import time

import httpx
from PIL import Image

from tessera.config import ServerArgs
from tessera.frontend.tokenizer_manager import TokenizerManager

logger = logging.getLogger("tessera.server")

WARMUP_TOKENS = 4
WARMUP_TIMEOUT_S = 120


def local_url(host: str, port: int) -> str:
    """Where this server can reach itself: the wildcard addresses through loopback."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def warm_up(args: ServerArgs, tm: TokenizerManager, api_key: str | None) -> None:
    """Runs the warm-up request; a failure is logged and the server serves anyway (a model whose prompts
    need more than text and images, e.g. Whisper's audio, is simply not warmed up)."""
    content: list[dict] = [{"type": "text", "text": "Describe the picture."}]
    if tm.info.has_image_understanding:
        png = io.BytesIO()
        Image.new("RGB", (320, 240), (128, 96, 64)).save(png, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
        content.insert(0, {"type": "image_url", "image_url": {"url": url}})
    body = {"model": args.model_name, "messages": [{"role": "user", "content": content}],
            "max_tokens": WARMUP_TOKENS, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.monotonic()
    try:
        async with httpx.AsyncClient(timeout=WARMUP_TIMEOUT_S) as client:
            async with client.stream("POST", f"{local_url(args.host, args.port)}/v1/chat/completions",
                                     json=body, headers=headers) as response:
                async for _ in response.aiter_lines():
                    pass
                if response.status_code != 200:
                    raise RuntimeError(f"HTTP {response.status_code}")
        await tm.flush_cache()
    except Exception as e:  # noqa: BLE001 - a warm-up is an optimisation, never a reason not to serve
        logger.warning("warm-up request failed (%s: %s); serving without it", type(e).__name__, e)
        return
    logger.info("warm-up request done (%s) in %.2f s", "an image and text" if len(content) > 1 else "text",
                time.monotonic() - start)
