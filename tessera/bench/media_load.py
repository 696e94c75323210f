"""Large-image load on a server: media payload per request and /health latency while requests preprocess.

    python -m tessera.bench.media_load [--model-path demo-vl] [--requests 16] [--images 4] [--size 1536x1024]

For each server setting (deferred vs eager preprocessing; frontend threads vs --mm-preprocess-workers), one
`tessera serve` is started with the image resolution kept (max_pixels = W*H, a context length that fits).
Then:
- payload: one request of `--images` noise JPEGs; bytes of media the scheduler received for it
  (`mm_transport_bytes` from /get_server_info), and how many items were deferred;
- health: `--requests` such requests at once while a client polls GET /health back to back; the latencies
  of the polls made before the last answer are summarised. With --frontend-only (the default) each load
  request also carries enough text to exceed the context length, so the frontend loads, hashes and
  preprocesses all its media and then refuses it (HTTP 400) before the scheduler computes anything: the
  window measured is media preprocessing alone, not the model's prefill competing for the cores.
Numbers depend on the machine and its load; compare settings side by side in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import multiprocessing
import statistics
import time

from tessera.bench.datasets import make_serving_dataset
from tessera.bench.report import LocalServer

SETTINGS = {
    "deferred, threads": [],
    "eager, threads": ["--disable-deferred-mm-preprocessing"],
    "deferred, 4 workers": ["--mm-preprocess-workers", "4"],
    "eager, 4 workers": ["--disable-deferred-mm-preprocessing", "--mm-preprocess-workers", "4"],
}


def _body(req, filler_words: int = 0) -> bytes:
    parts = [{"type": "image_url", "image_url": {"url": f"data:{req.image_mime};base64,"
                                                       + base64.b64encode(img).decode()}} for img in req.images]
    parts.append({"type": "text", "text": req.text + " word" * filler_words})
    # Encoded once here, so the load client does little more than write bytes to the socket.
    return json.dumps({"messages": [{"role": "user", "content": parts}], "max_tokens": 1,
                       "temperature": 0}).encode()


def _stats(base_url: str) -> dict:
    import httpx

    return httpx.get(f"{base_url}/get_server_info", timeout=60).json()["stats"]


def _percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


async def _fire(base_url: str, bodies: list[bytes], refused_ok: bool = False) -> list[float]:
    import httpx

    async with httpx.AsyncClient(timeout=1800) as client:
        async def one(body: bytes) -> float:
            t = time.monotonic()
            r = await client.post(f"{base_url}/v1/chat/completions", content=body,
                                  headers={"content-type": "application/json"})
            if not (refused_ok and r.status_code == 400):
                r.raise_for_status()
            return time.monotonic() - t

        return list(await asyncio.gather(*(one(b) for b in bodies)))


def _poll_health(base_url: str, stop, out) -> None:
    """GET /health back to back until `stop` is set; the latencies (s) go to `out`. Runs in its own process:
    a thread of the load client would wait on that client's GIL, not on the server."""
    import httpx

    times = []
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            t = time.monotonic()
            c.get(f"{base_url}/health")
            times.append(time.monotonic() - t)
            time.sleep(0.005)
    out.put(times)


def run_setting(model_path: str, extra: list[str], bodies: list[bytes], load: list[bytes], context_length: int,
                max_pixels: int, refused_ok: bool) -> dict:
    server = LocalServer(model_path, "--mm-process-config", json.dumps({"image": {"max_pixels": max_pixels}}),
                         "--context-length", str(context_length), "--max-total-tokens",
                         str(context_length * 2), *extra, startup_timeout_s=600)
    try:
        asyncio.run(_fire(server.base_url, bodies[:1]))  # warm-up (and the worker's first processor load)
        before = _stats(server.base_url)
        asyncio.run(_fire(server.base_url, bodies[:1]))
        after = _stats(server.base_url)
        payload = {m: after["mm_transport_bytes"][m] - before["mm_transport_bytes"].get(m, 0)
                   for m in after["mm_transport_bytes"]}
        deferred = after["mm_deferred_items"] - before["mm_deferred_items"]
        eager = after["mm_eager_items"] - before["mm_eager_items"]

        ctx = multiprocessing.get_context("spawn")
        stop, out = ctx.Event(), ctx.Queue()
        poller = ctx.Process(target=_poll_health, args=(server.base_url, stop, out))
        poller.start()
        time.sleep(2.0)  # the poller's interpreter is up and polling
        t0 = time.monotonic()
        latencies = asyncio.run(_fire(server.base_url, load, refused_ok))
        wall = time.monotonic() - t0
        stop.set()
        health = out.get(timeout=60)
        poller.join()
        return {"payload_bytes_per_request": payload, "deferred_items": deferred, "eager_items": eager,
                "health_ms": {"n": len(health), "median": 1000 * statistics.median(health),
                              "p99": 1000 * _percentile(health, 0.99), "max": 1000 * max(health)},
                "requests_wall_s": wall, "request_median_s": statistics.median(latencies)}
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="demo-vl")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--images", type=int, default=4)
    p.add_argument("--size", default="1536x1024")
    p.add_argument("--context-length", type=int, default=8192)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--output-json", default=None)
    p.add_argument("--with-prefill", action="store_true",
                   help="load requests fit the context (the window then includes the model's prefill)")
    ns = p.parse_args(argv)
    w, h = (int(x) for x in ns.size.split("x"))
    reqs = make_serving_dataset("random-image", ns.requests + 1, image_resolution=ns.size, image_count=ns.images,
                                input_len=8, output_len=1)
    bodies = [_body(r) for r in reqs[:1]]
    # Text beyond the context length once the images' tokens are in: refused after preprocessing.
    filler = 0 if ns.with_prefill else ns.context_length
    load = [_body(r, filler) for r in reqs[1:]]
    results = {}
    for name in ns.settings:
        results[name] = run_setting(ns.model_path, SETTINGS[name], bodies, load, ns.context_length, w * h,
                                    refused_ok=not ns.with_prefill)
        print(name, json.dumps(results[name]), flush=True)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
