"""`tessera bench offline`: the same workloads through tessera.Engine and through HF `generate`.

Workloads (see datasets.offline_workload):
  a  64 image requests, mixed image sizes, output lengths 16..128      -> output tok/s, Tessera vs HF
  b  64 requests over 8 distinct images                                 -> tok/s with and without Tessera's
     caches (radix prefix cache + encoder cache), and the TTFT of a repeated vs a first-seen image
  c  64 requests sharing a 512-token system prompt                      -> prefill tokens computed with
     and without caches
  d  one request (and 32 for the record), decode only                   -> ms per output token

Every request is greedy with its output length forced (Tessera: ignore_eos; HF: eos_token_id=None), so
both sides produce exactly the same number of tokens and neither stops at, nor bans, EOS. HF runs static batches
(left padding) in request order: a batch decodes until its longest request is done, which is the
cost of static batching that continuous batching removes; only the requested tokens are counted.
Each timed run starts from empty caches; the figure reported is the median over --num-runs.

--dtype sets both sides' dtype (Tessera's engine and HF's from_pretrained). Workload a's timed runs also
record each request's greedy tokens and chosen-token logprobs on both sides (a float32 log_softmax of the
logits per step, the same work on each side), and the result reports how far Tessera's outputs agree with
HF's (see bench/agreement.py): in float32 they should be identical, in bfloat16 rounding splits some.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tessera.bench.agreement import GreedyOutput, agreement, format_agreement
from tessera.bench.datasets import (
    OFFLINE_WORKLOADS,
    OfflineRequest,
    Workload,
    long_text,
    offline_workload,
)

NOCACHE_ARGS = {"disable_radix_cache": True, "mm_cache_size_mb": 0}


@dataclass(frozen=True)
class OfflineConfig:
    model_path: str = "demo-vl"
    workloads: tuple[str, ...] = OFFLINE_WORKLOADS
    compare_hf: bool = True
    num_runs: int = 3
    seed: int = 0
    num_requests: int = 64  # per workload (d: batch 1 and min(32, this))
    max_output_len: int | None = None  # caps every output length (smoke runs)
    decode_len: int = 64  # workload d's output length
    system_prompt_len: int = 512  # workload c's shared prefix, in tokens
    num_distinct_images: int = 8  # workload b
    hf_batch_size: int = 16
    engine_args: dict[str, Any] = field(default_factory=dict)
    # Both sides: Tessera's engine dtype and HF's from_pretrained dtype. auto: engine_args' dtype if it has one,
    # else the checkpoint's (as the engine resolves it).
    dtype: str = "auto"

    def __post_init__(self) -> None:
        bad = [w for w in self.workloads if w not in OFFLINE_WORKLOADS]
        if bad or not self.workloads:
            raise ValueError(f"workload: expected a, b, c, d or all, got {', '.join(bad) or 'nothing'}")
        for name in ("num_runs", "num_requests", "hf_batch_size", "system_prompt_len", "num_distinct_images"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.decode_len < 2:
            raise ValueError(f"decode_len: must be >= 2 (decode time is T(n) - T(1)), got {self.decode_len}")
        if self.max_output_len is not None and self.max_output_len < 1:
            raise ValueError(f"max_output_len: must be >= 1, got {self.max_output_len}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: expected auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.dtype != "auto" and self.engine_args.get("dtype", self.dtype) != self.dtype:
            raise ValueError(f"dtype: {self.dtype} disagrees with engine_args' dtype {self.engine_args['dtype']}")

    @property
    def run_dtype(self) -> str:
        return self.engine_args.get("dtype", "auto") if self.dtype == "auto" else self.dtype

    @property
    def tessera_args(self) -> dict[str, Any]:
        return {**self.engine_args, "dtype": self.run_dtype}


def machine_info() -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    from tessera.config import ServerArgs

    # HF generate runs in this process with torch's default threads; Tessera's model runs in its scheduler
    # process with ServerArgs.cpu_threads (default: adaptive, the cores nothing else is using; see
    # platform/threads.py); tessera_scheduler_threads is the count it starts with.
    info = {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "tessera_scheduler_threads": ServerArgs().scheduler_threads,
            "python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def _fit_tokens(tokenizer, text: str, num_tokens: int) -> str:
    """A prefix of text that is exactly num_tokens tokens (checked by re-encoding)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < num_tokens:
        raise ValueError(f"system_prompt_len: filler text has only {len(ids)} tokens, need {num_tokens}")
    # Decoding a cut and re-encoding it can merge across the cut; try nearby cuts until one is exact.
    for k in sorted(range(num_tokens - 8, num_tokens + 9), key=lambda k: abs(k - num_tokens)):
        cut = tokenizer.decode(ids[:k])
        if len(tokenizer.encode(cut, add_special_tokens=False)) == num_tokens:
            return cut
    raise ValueError(f"system_prompt_len: cannot cut the filler text at exactly {num_tokens} tokens")


def build_workloads(cfg: OfflineConfig, processor) -> dict[str, Workload]:
    def prompt(r: OfflineRequest) -> str:
        content = [{"type": "image"} for _ in r.images] + [{"type": "text", "text": r.question}]
        msgs = ([{"role": "system", "content": r.system}] if r.system else []) + [{"role": "user", "content": content}]
        return processor.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)

    kw = dict(seed=cfg.seed, num_requests=cfg.num_requests, max_output_len=cfg.max_output_len)
    reqs: dict[str, list[OfflineRequest]] = {"a": offline_workload("a", **kw)}
    if "b" in cfg.workloads:
        reqs["b"] = offline_workload("b", num_distinct_images=cfg.num_distinct_images, **kw)
    if "c" in cfg.workloads:
        system = _fit_tokens(processor.tokenizer, long_text(cfg.seed, 4 * cfg.system_prompt_len),
                             cfg.system_prompt_len)
        reqs["c"] = offline_workload("c", system_prompt=system, **kw)
    return {k: Workload([prompt(r) for r in v], v) for k, v in reqs.items()}


def decode_workloads(work_a: Workload, cfg: OfflineConfig) -> dict[str, Workload]:
    n = min(cfg.decode_len, cfg.max_output_len or cfg.decode_len)
    big = min(32, len(work_a.requests))
    return {"bs1": work_a.head(1, n), f"bs{big}": work_a.head(big, n)}


class Runner(Protocol):
    """One system under test. run() returns wall seconds for the workload, from empty caches; with record,
    last_outputs then holds each request's greedy tokens and their logprobs."""

    last_outputs: list[GreedyOutput]

    def run(self, work: Workload, output_len: int | None = None, batch_size: int | None = None,
            record: bool = False) -> float: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------- Tessera


class TesseraRunner:
    def __init__(self, model_path: str, engine_args: dict[str, Any]):
        from tessera.entrypoints.engine import Engine

        self.engine = Engine(model_path, show_progress=False, **engine_args)
        self.last_prefill_tokens = 0  # prompt tokens the last run() actually computed (not served from cache)
        self.last_outputs: list[GreedyOutput] = []

    def close(self) -> None:
        self.engine.shutdown()

    def run(self, work: Workload, output_len: int | None = None, batch_size: int | None = None,
            record: bool = False) -> float:
        """Wall seconds for the whole workload from empty caches. All requests are submitted at
        once; batch_size is HF's knob (the scheduler forms its own batches) and is ignored."""
        self.engine.flush_cache()  # ordered before the requests on the same socket
        lens = [output_len or r.output_len for r in work.requests]
        params = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in lens]
        images = [list(r.images) for r in work.requests]
        before = self.engine.get_stats().num_prefill_tokens_computed  # outside the timing: a scheduler round trip
        t0 = time.perf_counter()
        outs = self.engine.generate(work.prompts, params, image_data=images, return_logprob=record)
        seconds = time.perf_counter() - t0
        self.last_prefill_tokens = self.engine.get_stats().num_prefill_tokens_computed - before
        got = [o["meta_info"]["completion_tokens"] for o in outs]
        if got != lens:  # a benchmark that produced other lengths would report a wrong tok/s
            raise RuntimeError(f"tessera produced {sum(got)} tokens, expected {sum(lens)}")
        if record:
            self.last_outputs = [
                GreedyOutput(o["output_ids"], [lp for lp, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]
        return seconds

    def ttft_probe(self, work: Workload, wave: int, output_len: int) -> tuple[float, float | None]:
        """Median TTFT (ms) of the first wave (first-seen images) and of the later waves (repeats).

        Requests go in waves of `wave` (one per distinct image), so every wave has the same batch
        shape and the only difference between first and later waves is what the caches hold."""
        self.engine.flush_cache()
        first: list[float] = []
        repeat: list[float] = []
        for start in range(0, len(work.requests), wave):
            part = Workload(work.prompts[start : start + wave], work.requests[start : start + wave])
            params = {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True}
            outs = self.engine.generate(part.prompts, params, image_data=[list(r.images) for r in part.requests])
            (first if start == 0 else repeat).extend(o["meta_info"]["ttft"] * 1000 for o in outs)
        return statistics.median(first), statistics.median(repeat) if repeat else None


# ---------------------------------------------------------------- driver


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def _throughput(runner: Runner, work: Workload, num_runs: int, record: bool = False) -> dict:
    secs, prefill = [], []
    for _ in range(num_runs):
        secs.append(runner.run(work, record=record))
        if isinstance(runner, TesseraRunner):
            prefill.append(runner.last_prefill_tokens)
    out = {"output_tokens": work.output_tokens, "seconds": secs, "tok_s": work.output_tokens / _median(secs)}
    if prefill:
        out["prefill_tokens"] = _median(prefill)
    return out


def _decode_ms(runner: Runner, work: Workload, n: int, num_runs: int) -> float:
    """ms per decode step over the whole batch: (T(n) - T(1)) / (n - 1), from medians, so prefill
    and per-call overheads cancel out."""
    bs = len(work.requests)  # one batch on both sides
    runner.run(work, output_len=2, batch_size=bs)  # untimed: the first call at a new batch shape grows buffers
    t1s, tns = [], []
    for _ in range(num_runs):  # interleaved, so a slow spell of the machine hits both sides of the difference
        t1s.append(runner.run(work, output_len=1, batch_size=bs))
        tns.append(runner.run(work, output_len=n, batch_size=bs))
    t1, tn = _median(t1s), _median(tns)
    return (tn - t1) / (n - 1) * 1000


def _measure(runner: Runner, cfg: OfflineConfig, works: dict[str, Workload], decode: dict[str, Workload],
             only: tuple[str, ...]) -> dict:
    """Each workload's figures; with HF compared, workload a's runs record their outputs (runner.last_outputs)."""
    res: dict[str, Any] = {}
    warm = works["a"].head(2, 2)  # first-call costs (lazy imports, allocator growth) stay out of the timings
    runner.run(warm)
    for w in only:
        if w == "d":
            n = decode["bs1"].requests[0].output_len
            res["d"] = {name: _decode_ms(runner, work, n, cfg.num_runs) for name, work in decode.items()}
            continue
        res[w] = _throughput(runner, works[w], cfg.num_runs, record=cfg.compare_hf and w == "a")
        if isinstance(runner, TesseraRunner) and w == "b":
            probe_len = min(8, works[w].requests[0].output_len)
            probes = [runner.ttft_probe(works[w], cfg.num_distinct_images, probe_len) for _ in range(cfg.num_runs)]
            res[w]["ttft_first_seen_ms"] = _median([p[0] for p in probes])
            repeats = [p[1] for p in probes if p[1] is not None]
            res[w]["ttft_repeat_ms"] = _median(repeats) if repeats else None  # None: fewer requests than images
    return res


def run_offline(cfg: OfflineConfig, log=print) -> dict:
    from transformers import AutoProcessor

    from tessera.bench.medium import resolve_bench_model
    from tessera.models.config import ModelConfig
    from tessera.platform.device import resolve_device, resolve_dtype

    model_path = resolve_bench_model(cfg.model_path, cfg.seed)
    processor = AutoProcessor.from_pretrained(model_path)
    works = build_workloads(cfg, processor)
    decode = decode_workloads(works["a"], cfg)
    out: dict[str, Any] = {"model_path": cfg.model_path, "config": dataclasses.asdict(cfg), "machine": machine_info(),
                           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "results": {}}
    device = str(resolve_device(cfg.engine_args.get("device", "auto")))
    dtype = resolve_dtype(cfg.run_dtype, ModelConfig.load(model_path).dtype, device)
    out["dtype"] = str(dtype).removeprefix("torch.")  # what both sides run in
    systems: list[tuple[str, Callable[[], Runner]]] = [("tessera", lambda: TesseraRunner(model_path, cfg.tessera_args))]
    if any(w in cfg.workloads for w in ("b", "c")):
        systems.append(("tessera_nocache", lambda: TesseraRunner(model_path, {**cfg.tessera_args, **NOCACHE_ARGS})))
    if cfg.compare_hf:
        from tessera.bench.hf_baseline import HFRunner

        systems.append(("hf", lambda: HFRunner(model_path, cfg.hf_batch_size, device, cfg.run_dtype)))
    per_system: dict[str, dict] = {}
    outputs: dict[str, list[GreedyOutput]] = {}  # workload a's greedy outputs, per system
    for name, make in systems:
        only = cfg.workloads if name != "tessera_nocache" else tuple(w for w in cfg.workloads if w in ("b", "c"))
        log(f"[{name}] workloads {', '.join(only)} x {cfg.num_runs} runs")
        runner = make()
        try:
            per_system[name] = _measure(runner, cfg, works, decode, only)
            if "a" in only and runner.last_outputs:
                outputs[name] = runner.last_outputs
        finally:
            runner.close()
    out["results"] = summarize(per_system, cfg.workloads)
    if "tessera" in outputs and "hf" in outputs:
        out["results"]["a"]["agreement_vs_hf"] = agreement(outputs["tessera"], outputs["hf"])
    if "d" in cfg.workloads:  # what batch-1 decode cannot beat on this machine
        from tessera.bench.memory_floor import memory_floor

        floor = memory_floor(model_path, dtype)
        out["results"]["d"]["memory_floor"] = floor
        out["results"]["d"]["bs1_vs_floor"] = out["results"]["d"]["tessera"]["bs1"] / floor["floor_ms"]
        out["results"]["d"]["bs1_vs_copy_floor"] = out["results"]["d"]["tessera"]["bs1"] / floor["copy_floor_ms"]
    return out


def summarize(per_system: dict[str, dict], workloads: tuple[str, ...]) -> dict:
    """Per-workload figures: each system's numbers plus the derived ratios."""
    res: dict[str, dict] = {}
    for w in workloads:
        entry = {name: sysres[w] for name, sysres in per_system.items() if w in sysres}
        t, hf, nc = entry.get("tessera"), entry.get("hf"), entry.get("tessera_nocache")
        if w == "d":
            if hf:  # how many times faster Tessera decodes than HF at batch 1
                entry["speedup_bs1"] = hf["bs1"] / t["bs1"] if t["bs1"] > 0 else None
            res[w] = entry
            continue
        if hf:
            entry["ratio_vs_hf"] = t["tok_s"] / hf["tok_s"]
        if nc:
            entry["cache_speedup"] = t["tok_s"] / nc["tok_s"]
        if nc and "prefill_tokens" in t and "prefill_tokens" in nc:
            entry["prefill_reduction_pct"] = 100.0 * (1 - t["prefill_tokens"] / max(1, nc["prefill_tokens"]))
        res[w] = entry
    return res


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f} ms"


def format_summary(result: dict) -> str:
    r = result["results"]
    lines = [f"offline benchmark: {result['model_path']} in {result.get('dtype', '?')} ({result['machine']['cpu']}, "
             f"{result['machine']['cpu_count']} cpus)"]
    for w in ("a", "b", "c"):
        if w not in r:
            continue
        e = r[w]
        s = f"  {w}: tessera {e['tessera']['tok_s']:.1f} tok/s"
        if "hf" in e:
            s += f" | hf {e['hf']['tok_s']:.1f} tok/s | ratio {e['ratio_vs_hf']:.2f}x"
        if "tessera_nocache" in e:
            s += f" | no caches {e['tessera_nocache']['tok_s']:.1f} tok/s (cache speedup {e['cache_speedup']:.2f}x)"
        lines.append(s)
        if "agreement_vs_hf" in e:
            lines.append(f"     greedy outputs vs hf: {format_agreement(e['agreement_vs_hf'])}")
        if w == "b":
            t = e["tessera"]
            s = f"     TTFT first-seen image {_ms(t['ttft_first_seen_ms'])}, repeated image {_ms(t['ttft_repeat_ms'])}"
            if "tessera_nocache" in e:
                nc = e["tessera_nocache"]
                s += f" (no caches: {_ms(nc['ttft_first_seen_ms'])} / {_ms(nc['ttft_repeat_ms'])})"
            lines.append(s)
        if "prefill_reduction_pct" in e:
            lines.append(f"     prefill tokens computed {e['tessera']['prefill_tokens']:.0f} with caches, "
                         f"{e['tessera_nocache']['prefill_tokens']:.0f} without ({e['prefill_reduction_pct']:.1f}% less)")
    if "d" in r:
        for name in ("tessera", "hf"):
            if name in r["d"]:
                per_bs = ", ".join(f"{ms:.2f} ({bs})" for bs, ms in r["d"][name].items())
                lines.append(f"  d: {name} ms per output token: {per_bs}")
        floor = r["d"].get("memory_floor")
        if floor:
            lines.append(f"  d: batch-1 memory floor {floor['floor_ms']:.2f} ms ({floor['weight_bytes'] / 1e6:.1f} MB of "
                         f"weights / {floor['read_bandwidth_gb_s']:.1f} GB/s read, copy {floor['copy_bandwidth_gb_s']:.1f} "
                         f"GB/s); tessera batch 1 is {r['d']['bs1_vs_floor']:.2f}x the floor "
                         f"({r['d']['bs1_vs_copy_floor']:.2f}x the copy-bandwidth floor, {floor['copy_floor_ms']:.2f} ms)")
    return "\n".join(lines)
