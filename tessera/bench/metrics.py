"""Per-request timings in, benchmark metrics out: throughput and latency percentiles.

Definitions follow SGLang's and vLLM's bench_serving so numbers can be compared side by side:
  TTFT  time from sending the request to the first streamed token
  ITL   gap between consecutive streamed chunks (a chunk may carry several tokens)
  TPOT  (e2e - ttft) / (output_tokens - 1), per request with at least two output tokens
  E2E   time from sending the request to its last byte
Throughputs divide the tokens of *successful* requests by the wall time of the whole run.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


def median_ms(fn: Callable[[], object], n: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """Median milliseconds of n calls of fn after one warm-up call (clock: wall, or the process's CPU time)."""
    fn()
    times = []
    for _ in range(n):
        t = clock()
        fn()
        times.append(clock() - t)
    return statistics.median(times) * 1e3


@dataclass
class RequestResult:
    """What one benchmark request measured (seconds), or why it failed."""

    success: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e_latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2e_latency - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True)
class LatencyStats:
    """Milliseconds; None everywhere when there was nothing to measure (never a made-up 0)."""

    count: int
    mean: float | None
    median: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def from_seconds(cls, values: list[float]) -> LatencyStats:
        if not values:
            return cls(0, None, None, None, None)
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        # numpy's default linear interpolation: the convention of SGLang's and vLLM's benchmarks.
        p50, p90, p99 = (float(np.percentile(ms, q)) for q in PERCENTILES)
        return cls(len(values), float(ms.mean()), p50, p90, p99)


@dataclass(frozen=True)
class BenchmarkMetrics:
    duration_s: float
    num_completed: int
    num_failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    input_throughput: float  # prompt tokens / s
    output_throughput: float  # output tokens / s
    total_throughput: float  # (prompt + output) tokens / s
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_ms: LatencyStats
    errors: dict[str, int]  # error message -> count, so a failing run says why

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> BenchmarkMetrics:
        """Inverse of to_dict (for result JSON files read back by the plotter and the report)."""
        latency = {k: LatencyStats(**d[k]) for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")}
        return cls(**{**d, **latency})


def compute_metrics(results: list[RequestResult], duration_s: float) -> BenchmarkMetrics:
    if duration_s <= 0:
        raise ValueError(f"duration_s: must be positive, got {duration_s}")
    ok = [r for r in results if r.success]
    errors: dict[str, int] = {}
    for r in results:
        if not r.success:
            errors[r.error] = errors.get(r.error, 0) + 1
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [t for r in ok if (t := r.tpot) is not None]
    return BenchmarkMetrics(
        duration_s=duration_s, num_completed=len(ok), num_failed=len(results) - len(ok),
        total_input_tokens=input_tokens, total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration_s, input_throughput=input_tokens / duration_s,
        output_throughput=output_tokens / duration_s,
        total_throughput=(input_tokens + output_tokens) / duration_s,
        ttft_ms=LatencyStats.from_seconds([r.ttft for r in ok]),
        tpot_ms=LatencyStats.from_seconds(tpots),
        itl_ms=LatencyStats.from_seconds([g for r in ok for g in r.itl]),
        e2e_ms=LatencyStats.from_seconds([r.e2e_latency for r in ok]),
        errors=errors,
    )


def _fmt(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def format_report(m: BenchmarkMetrics, title: str = "Serving benchmark") -> str:
    """The human-readable summary printed at the end of a run."""
    lines = [f"{'=' * 20} {title} {'=' * 20}",
             f"{'Successful requests:':<34}{m.num_completed}",
             f"{'Failed requests:':<34}{m.num_failed}",
             f"{'Benchmark duration (s):':<34}{m.duration_s:.2f}",
             f"{'Total input tokens:':<34}{m.total_input_tokens}",
             f"{'Total output tokens:':<34}{m.total_output_tokens}",
             f"{'Request throughput (req/s):':<34}{m.request_throughput:.2f}",
             f"{'Input token throughput (tok/s):':<34}{m.input_throughput:.2f}",
             f"{'Output token throughput (tok/s):':<34}{m.output_throughput:.2f}",
             f"{'Total token throughput (tok/s):':<34}{m.total_throughput:.2f}"]
    for name, s in (("TTFT", m.ttft_ms), ("TPOT", m.tpot_ms), ("ITL", m.itl_ms), ("E2E", m.e2e_ms)):
        lines.append(f"{'-' * 22} {name} (ms) {'-' * 22}")
        lines.append(f"  mean {_fmt(s.mean):>10}  median {_fmt(s.median):>10}  "
                     f"p90 {_fmt(s.p90):>10}  p99 {_fmt(s.p99):>10}")
    for msg, n in sorted(m.errors.items(), key=lambda kv: -kv[1])[:5]:
        lines.append(f"error x{n}: {msg}")
    return "\n".join(lines)
