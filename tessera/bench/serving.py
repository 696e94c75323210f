"""`tessera bench serving`: load-test any OpenAI-compatible chat server with multimodal requests.

Requests go through the official `openai` AsyncOpenAI client with streaming on, so TTFT and
inter-token gaps are what a real client sees. Arrivals are a Poisson process at `request_rate`
(infinite: all at once), and at most `max_concurrency` requests are in flight. Output lengths are
forced with `ignore_eos` + `min_tokens` in the request's extra body (SGLang and vLLM both accept
these), so throughput does not depend on when a model happens to stop.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from tessera.bench.datasets import BenchRequest, make_serving_dataset, poisson_intervals
from tessera.bench.metrics import BenchmarkMetrics, RequestResult, compute_metrics, format_report
from tessera.bench.rss import RssSampler, format_memory, server_pid


@dataclass(frozen=True)
class ServingConfig:
    base_url: str
    model: str | None = None  # None: the first model the server lists
    dataset: str = "random-image"
    num_prompts: int = 100
    request_rate: float = float("inf")
    max_concurrency: int | None = None
    image_resolution: str = "448x448"
    image_count: int = 1
    output_len: int = 128
    input_len: int = 32
    video_frames: int = 8
    audio_seconds: float = 4.0
    seed: int = 0
    ignore_eos: bool = True
    temperature: float = 0.0
    api_key: str = "none"
    timeout_s: float = 600.0
    num_warmup: int = 1
    disable_tqdm: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    # Whose RSS to sample during the run (its whole process tree); None: the process listening on
    # base_url's port when that is this machine; 0: do not sample.
    server_pid: int | None = None

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency: must be >= 1, got {self.max_concurrency}")
        if self.num_warmup < 0:
            raise ValueError(f"num_warmup: must be >= 0, got {self.num_warmup}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url: expected http(s)://host:port, got {self.base_url!r}")

    @property
    def api_base(self) -> str:
        """The OpenAI client's base: accepts the server root or its /v1."""
        base = self.base_url.rstrip("/")
        return base if base.endswith("/v1") else base + "/v1"


def _make_client(cfg: ServingConfig, concurrency: int):
    try:
        import httpx
        from openai import AsyncOpenAI
    except ImportError as e:  # the openai client is a test/bench extra, not a serving dependency
        raise ValueError(f"openai: the serving benchmark needs the `openai` package ({e}); "
                         "pip install 'openai>=1.50'") from None
    # One connection per in-flight request: a pool smaller than the concurrency would queue
    # requests in the client and show up as server latency.
    limits = httpx.Limits(max_connections=max(concurrency, 1) + 8, max_keepalive_connections=max(concurrency, 1) + 8)
    http = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(cfg.timeout_s))
    return AsyncOpenAI(base_url=cfg.api_base, api_key=cfg.api_key, max_retries=0, http_client=http)


def _error_text(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}"[:300]


async def send_request(client, model: str, messages: list[dict], output_len: int, cfg: ServingConfig) -> RequestResult:
    """Streams one chat completion and times it; never raises for server-side failures."""
    extra: dict[str, Any] = dict(cfg.extra_body)
    if cfg.ignore_eos:
        extra.update(ignore_eos=True, min_tokens=output_len)
    start = time.perf_counter()
    ttft: float | None = None
    last = start
    itl: list[float] = []
    num_chunks = 0
    usage = None
    try:
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=output_len, temperature=cfg.temperature,
            stream=True, stream_options={"include_usage": True}, extra_body=extra or None)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                usage = chunk.usage
            if not chunk.choices:
                continue
            if chunk.choices[0].delta.content:
                if ttft is None:
                    ttft = now - start
                else:
                    itl.append(now - last)
                last = now
                num_chunks += 1
            elif chunk.choices[0].finish_reason and ttft is None:
                # No text at all (e.g. only special tokens, skipped in the text): the finish is the
                # first sign of output. A finish after text is not a token, so it adds no ITL gap.
                ttft = now - start
    except Exception as e:  # recorded per request: one bad reply must not end the benchmark
        return RequestResult(success=False, error=_error_text(e), e2e_latency=time.perf_counter() - start)
    e2e = time.perf_counter() - start
    if ttft is None:
        return RequestResult(success=False, error="no output tokens in the stream", e2e_latency=e2e)
    # Servers that omit usage: count streamed chunks (exact when each chunk carries one token).
    output_tokens = usage.completion_tokens if usage is not None else num_chunks
    prompt_tokens = usage.prompt_tokens if usage is not None else 0
    return RequestResult(success=True, prompt_tokens=prompt_tokens, output_tokens=output_tokens, ttft=ttft,
                         e2e_latency=e2e, itl=itl)


async def _resolve_model(client, cfg: ServingConfig) -> str:
    if cfg.model:
        return cfg.model
    try:
        models = await client.models.list()
    except Exception as e:  # connection refused, 404...: the user's URL is the likely cause
        raise ValueError(f"base_url: cannot list the models at {cfg.api_base}/models ({_error_text(e)}); "
                         "is the server up? (or pass --model)") from None
    if not models.data:
        raise ValueError("model: the server lists no models; pass --model")
    return models.data[0].id


async def run_benchmark_async(cfg: ServingConfig, requests: list[BenchRequest] | None = None) -> dict:
    """Runs the benchmark and returns the result dict that --output-json writes."""
    if requests is None:
        requests = make_serving_dataset(cfg.dataset, cfg.num_prompts, seed=cfg.seed,
                                        image_resolution=cfg.image_resolution, image_count=cfg.image_count,
                                        output_len=cfg.output_len, input_len=cfg.input_len,
                                        video_frames=cfg.video_frames, audio_seconds=cfg.audio_seconds)
    intervals = poisson_intervals(len(requests), cfg.request_rate, cfg.seed)
    # Base64 data URIs are built now, not inside each request's timing.
    jobs = [(r.openai_messages(), r.output_len) for r in requests]
    concurrency = cfg.max_concurrency or len(requests)
    client = _make_client(cfg, concurrency)
    try:
        model = await _resolve_model(client, cfg)
        # Warm-up requests are not timed: the first request pays one-off costs (lazy imports, allocator growth).
        for messages, output_len in jobs[: cfg.num_warmup]:
            warm = await send_request(client, model, messages, output_len, cfg)
            if not warm.success:
                raise ValueError(f"warm-up request failed, is the server up at {cfg.api_base}? {warm.error}")
        pid = server_pid(cfg.base_url) if cfg.server_pid is None else cfg.server_pid
        sampler = RssSampler(pid).start() if pid else None
        try:
            results, start = await _run_load(client, model, jobs, intervals, cfg)
            duration = time.perf_counter() - start
        finally:
            memory = sampler.stop() if sampler is not None else None
    finally:
        await client.close()
    metrics = compute_metrics(results, duration)
    return {"backend": "openai-chat", "model": model, "config": _config_dict(cfg),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "metrics": metrics.to_dict(), "server_memory": memory,
            "requests": [{"success": r.success, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                          "ttft": r.ttft, "e2e_latency": r.e2e_latency, "error": r.error} for r in results]}


async def _run_load(client, model: str, jobs: list[tuple[list[dict], int]], intervals: list[float],
                    cfg: ServingConfig) -> tuple[list[RequestResult], float]:
    """Sends the jobs on the arrival schedule; returns their results and the start time."""
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    bar = None
    if not cfg.disable_tqdm:
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), desc="requests", unit="req")

    async def one(messages: list[dict], output_len: int) -> RequestResult:
        if sem is None:
            res = await send_request(client, model, messages, output_len, cfg)
        else:
            async with sem:
                res = await send_request(client, model, messages, output_len, cfg)
        if bar is not None:
            bar.update(1)
        return res

    start = time.perf_counter()
    tasks = []
    for (messages, output_len), gap in zip(jobs, intervals):
        tasks.append(asyncio.create_task(one(messages, output_len)))
        if gap > 0:
            await asyncio.sleep(gap)
    try:
        results = list(await asyncio.gather(*tasks))
    finally:
        if bar is not None:
            bar.close()
    return results, start


def _config_dict(cfg: ServingConfig) -> dict:
    d = asdict(cfg)
    d.pop("api_key")  # never written to result files
    d["request_rate"] = "inf" if d["request_rate"] == float("inf") else d["request_rate"]
    return d


def run_serving(cfg: ServingConfig, output_json: str | None = None, quiet: bool = False) -> dict:
    result = asyncio.run(run_benchmark_async(cfg))
    if not quiet:
        print(format_report(BenchmarkMetrics.from_dict(result["metrics"]), f"{cfg.dataset} @ rate={cfg.request_rate} "
                                                   f"concurrency={cfg.max_concurrency or 'unbounded'}"))
        if result["server_memory"]:
            print(format_memory(result["server_memory"]))
    if output_json:
        with open(output_json, "w") as f:
            json.dump(result, f, indent=2)
    return result
