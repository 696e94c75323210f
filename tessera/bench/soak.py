"""`tessera bench soak`: many chat requests at a fixed concurrency, a share of them hostile, against a server.

Normal requests are scene questions about rendered images (demo-vl's skill); hostile ones are corrupt and
truncated media, a pixel bomb, unsupported schemes, private / metadata / unreachable URLs, paths outside the
allowed directory, 50 images in one message, a huge prompt, bad base64, a malformed body. It checks:

- every request is answered (no timeout, no dropped connection) and no response is >= 500;
- every hostile request gets a 4xx in OpenAI's error shape ({"error": {"message", "type", "code"}});
- normal answers under load equal the answers the same requests got alone, one at a time, before the run;
- after the drain, /metrics is back to idle: no running, queued or frontend requests, no KV held by
  requests, and the caches within their configured sizes.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import struct
import time
import zlib
from collections import Counter
from dataclasses import dataclass, field

HOSTILE_KINDS = ("corrupt_image", "truncated_image", "pixel_bomb", "unsupported_scheme", "private_url",
                 "metadata_url", "unreachable_url", "outside_allowed_dir", "fifty_images", "huge_prompt",
                 "corrupt_video", "bad_base64", "malformed_json", "image_part_without_url")
IDLE_GAUGES = ("tessera_num_running_reqs", "tessera_num_queue_reqs", "tessera_num_frontend_reqs",
               "tessera_kv_used_tokens")
CACHE_GAUGES = ("tessera_encoder_cache_bytes", "tessera_preprocess_cache_bytes", "tessera_radix_cache_tokens")


@dataclass(frozen=True)
class SoakConfig:
    base_url: str
    num_requests: int = 1000
    concurrency: int = 32
    hostile_fraction: float = 0.05
    max_tokens: int = 16
    distinct_prompts: int = 40
    seed: int = 0
    timeout_s: float = 300.0
    api_key: str | None = None
    drain_timeout_s: float = 30.0


@dataclass
class Job:
    index: int
    kind: str  # "normal" or one of HOSTILE_KINDS
    body: bytes
    prompt_id: int = -1  # normal requests: which distinct prompt


@dataclass
class Outcome:
    kind: str
    status: int | None
    latency: float
    error_shape_ok: bool = True
    answer: str | None = None
    prompt_id: int = -1
    exception: str | None = None


@dataclass
class SoakResult:
    config: dict
    wall_s: float
    statuses: dict = field(default_factory=dict)
    by_kind: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    idle_before: dict = field(default_factory=dict)
    idle_after: dict = field(default_factory=dict)
    latency_p50_s: float = 0.0
    latency_p99_s: float = 0.0
    answers_equal_alone: float = 0.0
    answers_correct: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures


# ---------------------------------------------------------------- inputs


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def pixel_bomb_png(side: int = 60000) -> bytes:
    """A valid PNG header claiming side x side pixels (3.6 G for the default), with a tiny body: a loader
    that trusted it would try to allocate gigabytes."""
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


def _chat(content, max_tokens: int) -> bytes:
    return json.dumps({"model": "default", "messages": [{"role": "user", "content": content}],
                       "max_tokens": max_tokens, "temperature": 0}).encode()


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def normal_prompts(n: int, seed: int) -> list[tuple[list, str]]:
    """(content, reference answer) of n scene questions about rendered images."""
    from tessera.demo import scenes

    rng = random.Random(seed)
    out = []
    for _ in range(n):
        s = scenes.image_sample(rng)
        out.append(([_image_part(_data_uri(_png(s.frames[0]))), {"type": "text", "text": s.question}], s.answer))
    return out


def hostile_body(kind: str, rng: random.Random, max_tokens: int) -> bytes:
    from PIL import Image

    ask = {"type": "text", "text": "How many shapes are there?"}
    small = _png(Image.new("RGB", (32, 32), (255, 255, 255)))
    if kind == "corrupt_image":
        return _chat([_image_part(_data_uri(rng.randbytes(2048))), ask], max_tokens)
    if kind == "truncated_image":
        full = _png(Image.effect_noise((256, 256), 64).convert("RGB"))
        return _chat([_image_part(_data_uri(full[: len(full) // 2])), ask], max_tokens)
    if kind == "pixel_bomb":
        return _chat([_image_part(_data_uri(pixel_bomb_png())), ask], max_tokens)
    if kind == "unsupported_scheme":
        return _chat([_image_part(rng.choice(["ftp://example.com/a.png", "gopher://example.com/a",
                                              "javascript:alert(1)", "s3://bucket/a.png"])), ask], max_tokens)
    if kind == "private_url":
        return _chat([_image_part(rng.choice(["http://127.0.0.1:1/a.png", "http://10.0.0.1/a.png",
                                              "http://[::1]:1/a.png", "http://localhost:1/a.png"])), ask],
                     max_tokens)
    if kind == "metadata_url":
        return _chat([_image_part(rng.choice(["http://169.254.169.254/latest/meta-data/",
                                              "http://[fd00:ec2::254]/latest/meta-data/",
                                              "http://[::ffff:169.254.169.254]/"])), ask], max_tokens)
    if kind == "unreachable_url":
        return _chat([_image_part("http://tessera-soak.invalid/a.png"), ask], max_tokens)
    if kind == "outside_allowed_dir":
        return _chat([_image_part(rng.choice(["/etc/passwd", "file:///etc/hostname", "../../../../etc/passwd"])),
                      ask], max_tokens)
    if kind == "fifty_images":
        return _chat([_image_part(_data_uri(small)) for _ in range(50)] + [ask], max_tokens)
    if kind == "huge_prompt":
        return _chat("hello " * 60000, max_tokens)
    if kind == "corrupt_video":
        return _chat([{"type": "video_url", "video_url": {"url": _data_uri(rng.randbytes(4096), "video/mp4")}},
                      ask], max_tokens)
    if kind == "bad_base64":
        return _chat([_image_part("data:image/png;base64,!!!not-base64!!!"), ask], max_tokens)
    if kind == "malformed_json":
        return b'{"messages": [{"role": "user", "content": "hi"}'
    if kind == "image_part_without_url":
        return _chat([{"type": "image_url", "image_url": {}}, ask], max_tokens)
    raise ValueError(f"unknown hostile kind {kind!r}")


def build_jobs(cfg: SoakConfig, prompts: list[tuple[list, str]]) -> list[Job]:
    rng = random.Random(cfg.seed)
    num_hostile = round(cfg.num_requests * cfg.hostile_fraction)
    hostile_at = set(rng.sample(range(cfg.num_requests), num_hostile))
    jobs, h = [], 0
    for i in range(cfg.num_requests):
        if i in hostile_at:
            kind = HOSTILE_KINDS[h % len(HOSTILE_KINDS)]
            h += 1
            jobs.append(Job(i, kind, hostile_body(kind, rng, cfg.max_tokens)))
        else:
            pid = rng.randrange(len(prompts))
            jobs.append(Job(i, "normal", _chat(prompts[pid][0], cfg.max_tokens), pid))
    return jobs


# ---------------------------------------------------------------- running


def _error_shape_ok(text: str) -> bool:
    try:
        err = json.loads(text)["error"]
        return isinstance(err["message"], str) and bool(err["message"]) and isinstance(err["type"], str) \
            and isinstance(err["code"], int)
    except (ValueError, KeyError, TypeError):
        return False


async def _send(client, cfg: SoakConfig, job: Job) -> Outcome:
    start = time.monotonic()
    try:
        r = await client.post("/v1/chat/completions", content=job.body,
                              headers={"content-type": "application/json"})
    except Exception as e:  # noqa: BLE001 - a dropped connection or a timeout is a finding, not a crash
        return Outcome(job.kind, None, time.monotonic() - start, False, prompt_id=job.prompt_id,
                       exception=f"{type(e).__name__}: {e}")
    latency = time.monotonic() - start
    answer = None
    if r.status_code == 200:
        try:
            answer = r.json()["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            answer = None
    shape = r.status_code == 200 or _error_shape_ok(r.text)
    return Outcome(job.kind, r.status_code, latency, shape, answer, job.prompt_id)


async def read_gauges(client) -> dict[str, float]:
    r = await client.get("/metrics")
    r.raise_for_status()
    values: dict[str, float] = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            values[name] = values.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return {k: values.get(k, float("nan")) for k in (*IDLE_GAUGES, *CACHE_GAUGES)}


async def _run(cfg: SoakConfig, progress: bool) -> SoakResult:
    import httpx

    headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency + 4, max_keepalive_connections=cfg.concurrency + 4)
    prompts = normal_prompts(cfg.distinct_prompts, cfg.seed)
    jobs = build_jobs(cfg, prompts)
    async with httpx.AsyncClient(base_url=cfg.base_url.rstrip("/").removesuffix("/v1"), timeout=cfg.timeout_s,
                                 headers=headers, limits=limits) as client:
        alone: dict[int, str | None] = {}
        for pid, (content, _) in enumerate(prompts):  # each distinct prompt once, with nothing else running
            o = await _send(client, cfg, Job(-1, "normal", _chat(content, cfg.max_tokens), pid))
            alone[pid] = o.answer
        idle_before = await read_gauges(client)
        sem = asyncio.Semaphore(cfg.concurrency)
        done = 0

        async def one(job: Job) -> Outcome:
            nonlocal done
            async with sem:
                out = await _send(client, cfg, job)
            done += 1
            if progress and done % 100 == 0:
                print(f"  {done}/{len(jobs)} answered", flush=True)
            return out

        start = time.monotonic()
        outcomes = await asyncio.gather(*(one(j) for j in jobs))
        wall = time.monotonic() - start
        deadline = time.monotonic() + cfg.drain_timeout_s
        while True:
            idle_after = await read_gauges(client)
            if all(idle_after[k] == 0 for k in IDLE_GAUGES) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
    return _judge(cfg, outcomes, alone, prompts, idle_before, idle_after, wall)


def _judge(cfg, outcomes: list[Outcome], alone, prompts, idle_before, idle_after, wall) -> SoakResult:
    res = SoakResult(config=vars(cfg) | {"api_key": None}, wall_s=wall, idle_before=idle_before,
                     idle_after=idle_after)
    res.statuses = dict(Counter(str(o.status) for o in outcomes))
    by_kind: dict[str, Counter] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, Counter())[str(o.status)] += 1
        if o.exception is not None:
            res.failures.append(f"{o.kind}: no answer ({o.exception})")
        elif o.status >= 500:
            res.failures.append(f"{o.kind}: HTTP {o.status}")
        elif o.kind != "normal" and not (400 <= o.status < 500 and o.error_shape_ok):
            res.failures.append(f"{o.kind}: HTTP {o.status} (expected a 4xx in OpenAI's error shape)")
        elif o.kind == "normal" and o.status != 200:
            res.failures.append(f"normal: HTTP {o.status}")
    res.by_kind = {k: dict(v) for k, v in sorted(by_kind.items())}
    normal = [o for o in outcomes if o.kind == "normal" and o.status == 200]
    if normal:
        res.answers_equal_alone = sum(o.answer == alone[o.prompt_id] for o in normal) / len(normal)
        res.answers_correct = sum((o.answer or "").strip() == prompts[o.prompt_id][1] for o in normal) / len(normal)
        lat = sorted(o.latency for o in normal)
        res.latency_p50_s = lat[len(lat) // 2]
        res.latency_p99_s = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        alone_correct = sum((alone[p] or "").strip() == prompts[p][1] for p in alone) / len(alone)
        if res.answers_correct < alone_correct - 0.05:
            res.failures.append(f"normal answers less accurate under load ({res.answers_correct:.3f}) than alone "
                                f"({alone_correct:.3f})")
    for k in IDLE_GAUGES:
        if idle_after[k] != 0:
            res.failures.append(f"after the drain {k} = {idle_after[k]:g}, not 0")
    return res


def run_soak(cfg: SoakConfig, progress: bool = True) -> SoakResult:
    return asyncio.run(_run(cfg, progress))


def format_result(r: SoakResult) -> str:
    lines = [f"soak: {r.config['num_requests']} requests, concurrency {r.config['concurrency']}, "
             f"{r.config['hostile_fraction']:.0%} hostile, {r.wall_s:.1f} s ({r.config['num_requests'] / r.wall_s:.1f} "
             f"req/s)",
             f"statuses: {dict(sorted(r.statuses.items()))}",
             f"normal: p50 {r.latency_p50_s:.2f} s, p99 {r.latency_p99_s:.2f} s; answers equal to alone "
             f"{r.answers_equal_alone:.3f}, correct {r.answers_correct:.3f}"]
    lines += [f"  {kind}: {statuses}" for kind, statuses in r.by_kind.items() if kind != "normal"]
    lines.append("idle before: " + ", ".join(f"{k.removeprefix('tessera_')}={v:g}" for k, v in r.idle_before.items()))
    lines.append("idle after:  " + ", ".join(f"{k.removeprefix('tessera_')}={v:g}" for k, v in r.idle_after.items()))
    lines.append("PASS" if r.ok else f"FAIL ({len(r.failures)}): " + "; ".join(r.failures[:10]))
    return "\n".join(lines)
