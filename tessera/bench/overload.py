"""`tessera bench overload`: a server held past its capacity, to show that --max-queued-requests sheds load
without hurting what it admitted.

Capacity is what the server admits at once: its running slots plus the queue it allows (--max-running-requests
+ --max-queued-requests). Clients, load_factor x capacity of them, send streamed chat requests about a rendered
scene back to back for duration_s; a 503 sends its client to wait retry_wait_s (Retry-After says 1 s; a client
that waits less keeps the pressure on). Checked:

- every refusal is a 503 with Retry-After and OpenAI's error body, and no other status >= 500 comes back;
- no admitted request is lost: every 200 stream ends with a finish_reason for its choice and [DONE];
- /metrics' tessera_rejected_requests_total grew by exactly the 503s counted here.

Reported: the admitted requests' latency (p50/p99 end-to-end and time to first token), and the same run at
load factor 1 first (baseline_s; no refusals expected there), so the overload's latencies have a reference.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field

REJECTED_METRIC = "tessera_rejected_requests_total"
FRONTEND_METRIC = "tessera_num_frontend_reqs"


@dataclass(frozen=True)
class OverloadConfig:
    base_url: str
    max_running: int
    max_queued: int
    duration_s: float = 120.0
    load_factor: float = 4.0
    baseline_s: float = 30.0
    max_tokens: int = 16
    retry_wait_s: float = 0.25
    timeout_s: float = 300.0
    api_key: str | None = None
    seed: int = 0

    def clients(self, load_factor: float) -> int:
        return max(1, math.ceil(load_factor * (self.max_running + self.max_queued)))


@dataclass
class Phase:
    load_factor: float
    clients: int
    duration_s: float
    sent: int = 0
    admitted: int = 0
    completed: int = 0
    lost: int = 0  # a 200 stream that ended (or broke) without its finish_reason and [DONE]
    rejected_503: int = 0
    bad_503: int = 0  # a 503 without Retry-After or OpenAI's error body
    other_5xx: int = 0
    other_status: dict[str, int] = field(default_factory=dict)
    client_errors: dict[str, int] = field(default_factory=dict)  # no status at all, by exception type
    # The server's own count of generations it holds (tessera_num_frontend_reqs), sampled every half second:
    # at most running + queued if admission holds.
    max_frontend_reqs: float = 0.0
    metrics_rejected_delta: float = 0.0
    latency_s: dict[str, float] = field(default_factory=dict)
    ttft_s: dict[str, float] = field(default_factory=dict)
    admitted_per_s: float = 0.0
    client_cpu_s: float = 0.0  # this process's CPU time over the phase: on a shared machine, taken from the server

    @property
    def ok(self) -> bool:
        return (self.other_5xx == 0 and self.lost == 0 and self.bad_503 == 0 and not self.client_errors
                and not self.other_status and self.completed == self.admitted > 0
                and self.metrics_rejected_delta == self.rejected_503)


def scene_image_uri(seed: int) -> str:
    from tessera.demo import scenes

    buf = io.BytesIO()
    scenes.render(scenes.random_scene(random.Random(seed))).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    s = sorted(values)

    def pick(q: float) -> float:  # nearest rank
        return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]

    return {"p50": pick(0.50), "p99": pick(0.99), "max": s[-1]}


async def _metric(client, base_url: str, name: str) -> float:
    text = (await client.get(f"{base_url}/metrics", timeout=30)).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


async def _one(client, cfg: OverloadConfig, body: dict, phase: Phase, latencies: list, ttfts: list) -> bool:
    """Sends one request; returns whether it was refused (the caller then waits before the next)."""
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    start = time.monotonic()
    phase.sent += 1
    try:
        async with client.stream("POST", f"{cfg.base_url}/v1/chat/completions", json=body, headers=headers,
                                 timeout=cfg.timeout_s) as r:
            if r.status_code == 503:
                phase.rejected_503 += 1
                error = json.loads(await r.aread()).get("error", {})
                if "retry-after" not in r.headers or not isinstance(error.get("message"), str):
                    phase.bad_503 += 1
                return True
            if r.status_code != 200:
                await r.aread()
                if r.status_code >= 500:
                    phase.other_5xx += 1
                phase.other_status[str(r.status_code)] = phase.other_status.get(str(r.status_code), 0) + 1
                return False
            phase.admitted += 1
            first, finish, done = None, None, False
            try:
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        continue
                    choice = json.loads(line[6:])["choices"][0]
                    if first is None and choice["delta"].get("content"):
                        first = time.monotonic() - start
                    finish = choice.get("finish_reason") or finish
            except Exception:  # the stream broke after its 200: the request was lost
                pass
            if done and finish is not None:
                phase.completed += 1
                latencies.append(time.monotonic() - start)
                if first is not None:
                    ttfts.append(first)
            else:
                phase.lost += 1
            return False
    except Exception as e:  # noqa: BLE001 - no status came back: counted, the run goes on
        kind = type(e).__name__
        phase.client_errors[kind] = phase.client_errors.get(kind, 0) + 1
        return False


async def _run_phase(cfg: OverloadConfig, load_factor: float, duration_s: float) -> Phase:
    import httpx

    phase = Phase(load_factor, cfg.clients(load_factor), duration_s)
    image = scene_image_uri(cfg.seed)
    questions = ("What color is the circle?", "Describe the picture.", "How many shapes are there?",
                 "Where is the square?")
    latencies: list[float] = []
    ttfts: list[float] = []
    # A connection per request: a kept-alive one that the server closes after its 5 s idle timeout just as a
    # starved client reuses it fails without a status, a client-side race that is not what is measured here.
    limits = httpx.Limits(max_connections=phase.clients + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits, timeout=cfg.timeout_s) as client:
        before = await _metric(client, cfg.base_url, REJECTED_METRIC)
        end = time.monotonic() + duration_s

        async def watch() -> None:
            async with httpx.AsyncClient(timeout=30, limits=limits) as own:  # not behind the workers' pool
                while time.monotonic() < end:
                    try:
                        held = await _metric(own, cfg.base_url, FRONTEND_METRIC)
                    except httpx.HTTPError:
                        continue
                    phase.max_frontend_reqs = max(phase.max_frontend_reqs, held)
                    await asyncio.sleep(0.5)

        async def worker(k: int) -> None:
            i = k
            while time.monotonic() < end:
                body = {"messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": image}},
                    {"type": "text", "text": questions[i % len(questions)]}]}],
                    "max_tokens": cfg.max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
                i += phase.clients
                if await _one(client, cfg, body, phase, latencies, ttfts):
                    await asyncio.sleep(cfg.retry_wait_s)

        t0, cpu0 = time.monotonic(), time.process_time()
        await asyncio.gather(watch(), *(worker(k) for k in range(phase.clients)))
        elapsed = time.monotonic() - t0  # includes the drain of what was in flight at the end
        phase.client_cpu_s = time.process_time() - cpu0
        phase.metrics_rejected_delta = await _metric(client, cfg.base_url, REJECTED_METRIC) - before
    phase.latency_s, phase.ttft_s = _percentiles(latencies), _percentiles(ttfts)
    phase.admitted_per_s = phase.completed / elapsed
    return phase


def run_overload(cfg: OverloadConfig) -> dict:
    phases = []
    if cfg.baseline_s > 0:
        phases.append(asyncio.run(_run_phase(cfg, 1.0, cfg.baseline_s)))
    phases.append(asyncio.run(_run_phase(cfg, cfg.load_factor, cfg.duration_s)))
    overload = phases[-1]
    return {"config": asdict(cfg), "phases": [{**asdict(p), "ok": p.ok} for p in phases],
            "ok": overload.ok and overload.rejected_503 > 0}


def format_result(result: dict) -> str:
    cfg = result["config"]
    lines = [f"capacity {cfg['max_running']} running + {cfg['max_queued']} queued; max_tokens {cfg['max_tokens']}, "
             f"a refused client waits {cfg['retry_wait_s']} s"]
    for p in result["phases"]:
        lat, ttft = p["latency_s"], p["ttft_s"]
        lines.append(
            f"x{p['load_factor']:g} ({p['clients']} clients, {p['duration_s']:.0f} s): sent {p['sent']}, admitted "
            f"{p['admitted']}, completed {p['completed']}, lost {p['lost']}, 503 {p['rejected_503']} (metrics "
            f"+{p['metrics_rejected_delta']:.0f}, malformed {p['bad_503']}), other 5xx {p['other_5xx']}, other "
            f"statuses {p['other_status'] or 0}, client errors {p['client_errors'] or 0}, at most "
            f"{p['max_frontend_reqs']:.0f} held; admitted "
            f"{p['admitted_per_s']:.2f} req/s, latency p50 {lat.get('p50', 0):.2f} s p99 {lat.get('p99', 0):.2f} s, "
            f"TTFT p50 {ttft.get('p50', 0):.2f} s p99 {ttft.get('p99', 0):.2f} s; client CPU {p['client_cpu_s']:.0f} s")
    lines.append("OK" if result["ok"] else "FAILED")
    return "\n".join(lines)
