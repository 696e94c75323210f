"""The HTTP server's warm-up: a few short chat requests to its own port before it says it is ready.

Why: a fresh server's first requests pay one-time costs (the HF processor's and tokenizer's lazy setup, image
decoding and resizing, the frontend's preprocessing threads, oneDNN's first kernels, the encode-ahead thread's
first call, the HTTP and SSE path, malloc growing the heap). On demo-vl the first wave of 16 image requests
waited up to 700-750 ms for its first tokens against 400-600 ms in later waves; one warm-up request brought it
to 534-644 ms, four at once (one per preprocessing thread) to 387-520 (docs/benchmarks.md, "Encoding ahead").
SGLang's server warms up the same way, with requests to itself (`--skip-server-warmup` turns it off, as there).

Each request streams a few tokens for one plain PNG (320 x 240, a size the processors resize; a colour of its
own, so none is a cache hit) where the model takes images, one second of a tone where it takes audio, text only
otherwise. They are ordinary requests (counted in /metrics like any other; their access-log lines, request ids
`warmup-N`, at debug level); the caches they filled are flushed afterwards. An encoder-decoder speech model
(Whisper) is warmed up with one transcription instead, an embedding server (--is-embedding, CLIP, SigLIP) with
embedding requests (a text, or an image alone where the model takes images).

Ready means ready: a warm-up that fails raises WarmupError with the server's own answer, and the server exits
with it instead of saying it is ready (a request it cannot serve, e.g. under a --max-total-tokens too small for
any prompt, would be refused for every user too).
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
import time

import httpx
import numpy as np
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


class WarmupError(RuntimeError):
    """The server could not answer its own warm-up request: it cannot serve."""


def _tone_wav(seconds: float = 1.0, rate: int = 16000) -> bytes:
    import soundfile as sf  # audio models only: a server for images runs without soundfile

    buf = io.BytesIO()
    t = np.arange(int(seconds * rate)) / rate
    sf.write(buf, (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), rate, format="WAV")
    return buf.getvalue()


async def warm_up(args: ServerArgs, tm: TokenizerManager, api_key: str | None) -> None:
    """Runs the warm-up requests; raises WarmupError with the server's answer when one fails."""
    info = tm.info

    def body(i: int) -> dict:
        content: list[dict] = [{"type": "text", "text": "Describe the picture." if info.has_image_understanding
                                else "Transcribe the audio." if info.has_audio_understanding else "Hello."}]
        if info.has_image_understanding:
            png = io.BytesIO()
            Image.new("RGB", (320, 240), (64 * i, 96, 255 - 64 * i)).save(png, format="PNG")
            url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
            content.insert(0, {"type": "image_url", "image_url": {"url": url}})
        elif info.has_audio_understanding:
            wav = base64.b64encode(_tone_wav()).decode()
            content.insert(0, {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}})
        if info.is_embedding:  # a text, or an image alone (what a dual encoder takes too)
            image = [c for c in content if c["type"] == "image_url"]
            return {"model": args.model_name, "input": [
                {"image": image[0]["image_url"]["url"]} if image and i % 2 else {"text": "Hello."}]}
        return {"model": args.model_name, "messages": [{"role": "user", "content": content}],
                "max_tokens": WARMUP_TOKENS, "temperature": 0, "stream": True}

    base, headers = local_url(args.host, args.port), {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=WARMUP_TIMEOUT_S) as client:
        async def check(response: httpx.Response) -> None:
            if response.status_code != 200:
                await response.aread()
                try:
                    why = response.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    why = response.text[:300]
                raise WarmupError(f"HTTP {response.status_code}: {why}")

        if info.config.family.encoder_decoder:  # Whisper: a transcription, its only kind of request
            files = {"file": ("warmup.wav", _tone_wav(), "audio/wav")}
            response = await client.post(f"{base}/v1/audio/transcriptions", files=files,
                                         data={"model": args.model_name},
                                         headers={**headers, "X-Request-Id": "warmup-0"})
            await check(response)
            count, what = 1, "a transcription"
        else:
            path = "/v1/embeddings" if info.is_embedding else "/v1/chat/completions"

            async def one(i: int) -> None:
                async with client.stream("POST", f"{base}{path}", json=body(i),
                                         headers={**headers, "X-Request-Id": f"warmup-{i}"}) as response:
                    await check(response)
                    async for _ in response.aiter_lines():
                        pass

            # No more than the running slots: a warm-up request must never wait in the queue or be refused.
            count = min(WARMUP_REQUESTS, args.max_running_requests)
            await asyncio.gather(*(one(i) for i in range(count)))
            what = ("embeddings of texts and images" if info.is_embedding and info.has_image_understanding else
                    "embeddings of texts" if info.is_embedding else
                    "each an image and text" if info.has_image_understanding else
                    "each audio and text" if info.has_audio_understanding else "text")
    await tm.flush_cache()
    logger.info("warm-up requests done (%d, %s) in %.2f s", count, what, time.monotonic() - start)
