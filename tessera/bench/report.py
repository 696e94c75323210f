"""Regenerates the results tables of docs/benchmarks.md: one command, medians of 3 runs.

    python -m tessera.bench.report                       # run everything, rewrite the doc's tables
    python -m tessera.bench.report --from-json DIR       # re-render from saved result files, no runs

Runs `tessera bench offline` (workloads a-d, with --compare hf) for each model and, unless
--no-serving, `tessera bench serving` against a `tessera serve` it starts on a free loopback
port, three times per concurrency level. Result JSONs and the latency plot go to --output-dir;
the tables replace whatever is between the markers in the doc.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

START_MARKER = "<!-- bench-results:start -->"
END_MARKER = "<!-- bench-results:end -->"
DEFAULT_DOC = Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"
SERVING_CONCURRENCY = (1, 4, 16)


# ---------------------------------------------------------------- running


class LocalServer:
    """`tessera serve` in a subprocess on a free loopback port (the port is the OS's choice)."""

    def __init__(self, model_path: str, *extra: str, startup_timeout_s: float = 300.0):
        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe nobody drains
        self.proc = self._start(["serve", "--model-path", model_path, "--host", "127.0.0.1", "--port", str(port),
                                 *extra])
        deadline = time.monotonic() + startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"tessera serve exited during startup:\n{self.log.read()[-2000:]}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)  # a start takes seconds; a coarse poll added ~0.25 s to each (tests start ~20)
        self.stop()
        raise RuntimeError(f"tessera serve did not become healthy within {startup_timeout_s:.0f} s")

    def _start(self, argv: list[str]) -> subprocess.Popen:
        """`python -m tessera argv...`, its output in self.log (the tests start it from a warm interpreter)."""
        return subprocess.Popen([sys.executable, "-m", "tessera", *argv], stdout=self.log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        """Everything the server printed so far."""
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        """SIGTERM (graceful), SIGKILL after 30 s; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> LocalServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def run_serving_sweep(model_path: str, out_dir: Path, num_runs: int, num_prompts: int, output_len: int) -> list[Path]:
    from tessera.bench.medium import resolve_bench_model
    from tessera.bench.serving import ServingConfig, run_serving

    paths = []
    with LocalServer(resolve_bench_model(model_path)) as server:
        for conc in SERVING_CONCURRENCY:
            for run in range(num_runs):
                path = out_dir / f"serving-{Path(model_path).name}-c{conc}-run{run}.json"
                cfg = ServingConfig(base_url=server.base_url, dataset="scenes", num_prompts=num_prompts,
                                    max_concurrency=conc, output_len=output_len, seed=run, disable_tqdm=True)
                run_serving(cfg, str(path), quiet=True)
                paths.append(path)
    return paths


# ---------------------------------------------------------------- rendering


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _pair(a: float | None, b: float | None, fmt: str = ".1f") -> str:
    return f"{_num(a, fmt)} / {_num(b, fmt)}"


def offline_table(results: list[dict]) -> str:
    """Rows are figures, one column per model (one result of `tessera bench offline` each)."""

    def get(r: dict, *keys: str) -> float | None:
        cur: object = r["results"]
        for k in keys:
            if not isinstance(cur, dict) or k not in cur:
                return None
            cur = cur[k]
        return cur if isinstance(cur, (int, float)) else None

    def big_bs(r: dict) -> str:
        keys = [k for k in (r["results"].get("d", {}).get("tessera") or {}) if k != "bs1"]
        return keys[0] if keys else "bs32"

    n = results[0]["config"].get("num_requests", 64) if results else 64
    rows: list[tuple[str, str, object]] = [
        (f"a: {n} image requests, mixed sizes, 16-128 output tokens", "output tok/s, Tessera / HF",
         lambda r: _pair(get(r, "a", "tessera", "tok_s"), get(r, "a", "hf", "tok_s"))),
        ("", "Tessera / HF", lambda r: _num(get(r, "a", "ratio_vs_hf"), ".2f") + "x"),
        (f"b: {n} requests over 8 distinct images", "output tok/s, caches on / off",
         lambda r: _pair(get(r, "b", "tessera", "tok_s"), get(r, "b", "tessera_nocache", "tok_s"))),
        ("", "cache speedup", lambda r: _num(get(r, "b", "cache_speedup"), ".2f") + "x"),
        ("", "Tessera / HF", lambda r: _num(get(r, "b", "ratio_vs_hf"), ".2f") + "x"),
        ("", "prefill tokens computed, caches on / off",
         lambda r: _pair(get(r, "b", "tessera", "prefill_tokens"), get(r, "b", "tessera_nocache", "prefill_tokens"),
                         ".0f")),
        ("", "TTFT ms, first-seen / repeated image",
         lambda r: _pair(get(r, "b", "tessera", "ttft_first_seen_ms"), get(r, "b", "tessera", "ttft_repeat_ms"))),
        (f"c: {n} requests, shared 512-token system prompt", "prefill tokens computed, caches on / off",
         lambda r: _pair(get(r, "c", "tessera", "prefill_tokens"), get(r, "c", "tessera_nocache", "prefill_tokens"),
                         ".0f")),
        ("", "prefill reduction", lambda r: _num(get(r, "c", "prefill_reduction_pct")) + "%"),
        ("", "Tessera / HF", lambda r: _num(get(r, "c", "ratio_vs_hf"), ".2f") + "x"),
        ("d: decode latency", "ms per output token at batch 1, Tessera / HF",
         lambda r: _pair(get(r, "d", "tessera", "bs1"), get(r, "d", "hf", "bs1"), ".2f")),
        ("", "ms per decode step at the larger batch, Tessera / HF",
         lambda r: _pair(get(r, "d", "tessera", big_bs(r)), get(r, "d", "hf", big_bs(r)), ".2f")
         + f" ({big_bs(r)[2:]})"),
        ("", "batch-1 memory floor ms (weight bytes / read bandwidth); Tessera batch 1 / floor",
         lambda r: _num(get(r, "d", "memory_floor", "floor_ms"), ".2f") + "; "
         + _num(get(r, "d", "bs1_vs_floor"), ".2f") + "x"),
        ("", "the same with the copy bandwidth (weight bytes / copy bandwidth)",
         lambda r: _num(get(r, "d", "memory_floor", "copy_floor_ms"), ".2f") + "; "
         + _num(get(r, "d", "bs1_vs_copy_floor"), ".2f") + "x"),
    ]
    head = "| workload | figure | " + " | ".join(r["model_path"] for r in results) + " |"
    lines = [head, "|" + "---|" * (2 + len(results))]
    for workload, figure, cell in rows:
        lines.append(f"| {workload} | {figure} | " + " | ".join(cell(r) for r in results) + " |")  # type: ignore[operator]
    return "\n".join(lines)


def serving_table(results: list[dict]) -> str:
    """One row per concurrency level; each figure is the median over the runs at that level."""
    by_conc: dict[int, list[dict]] = {}
    for r in results:
        by_conc.setdefault(int(r["config"]["max_concurrency"] or 0), []).append(r["metrics"])

    def med(ms: list[dict], *keys: str) -> float | None:
        vals = []
        for m in ms:
            v: object = m
            for k in keys:
                v = v[k]  # type: ignore[index]
            if v is not None:
                vals.append(float(v))  # type: ignore[arg-type]
        return statistics.median(vals) if vals else None

    lines = ["| concurrency | runs | req/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 ms | E2E p50 ms | failed |",
             "|---|---|---|---|---|---|---|---|"]
    for conc in sorted(by_conc):
        ms = by_conc[conc]
        lines.append(f"| {conc} | {len(ms)} | {_num(med(ms, 'request_throughput'), '.2f')} | "
                     f"{_num(med(ms, 'output_throughput'))} | "
                     f"{_pair(med(ms, 'ttft_ms', 'median'), med(ms, 'ttft_ms', 'p99'))} | "
                     f"{_num(med(ms, 'tpot_ms', 'median'))} | {_num(med(ms, 'e2e_ms', 'median'))} | "
                     f"{sum(m['num_failed'] for m in ms)} |")
    return "\n".join(lines)


def render(offline: list[dict], serving: list[dict]) -> str:
    parts = []
    offline = sorted(offline, key=lambda r: r["date"])  # columns in the order the models were run
    machine = (offline[0] if offline else {}).get("machine")
    if machine:
        gpu = f", GPU {machine['gpu']}" if machine.get("gpu") else ""
        dates = sorted({r["date"] for r in offline} | {r["date"] for r in serving if "date" in r})
        when = dates[0] if len(dates) == 1 else f"between {dates[0]} and {dates[-1]}"
        parts.append(f"Measured {when} on {machine['cpu']} ({machine['cpu_count']} CPUs, "
                     f"{machine['torch_threads']} torch threads{gpu}), Python {machine['python']}, "
                     f"torch {machine['torch']}. Each figure is the median of "
                     f"{offline[0]['config']['num_runs']} run(s). The serving client runs on the same machine "
                     "as the server.")
    if offline:
        parts.append("### Offline: tessera.Engine vs HF transformers `generate`\n\n" + offline_table(offline))
    if serving:
        cfg = serving[0]["config"]
        parts.append(f"### Serving: `tessera serve --model-path {serving[0]['model']}`, dataset {cfg['dataset']}, "
                     f"{cfg['num_prompts']} prompts, {cfg['output_len']} output tokens\n\n" + serving_table(serving))
    return "\n\n".join(parts) if parts else "_Not yet measured._"


def update_doc(doc: Path, body: str) -> None:
    text = doc.read_text()
    start, end = text.find(START_MARKER), text.find(END_MARKER)
    if start < 0 or end < start:
        raise ValueError(f"doc: {doc} lacks the markers {START_MARKER} ... {END_MARKER}")
    doc.write_text(text[: start + len(START_MARKER)] + "\n" + body.strip() + "\n" + text[end:])


def load_dir(directory: Path) -> tuple[list[dict], list[dict]]:
    """The report's own result files only (the names main() writes): other benchmark JSONs kept in the same
    directory, e.g. a hand-run serving check on another dataset, must not be mixed into its tables."""
    offline = [json.loads(p.read_text()) for p in sorted(directory.glob("offline-*.json"))]
    serving = [json.loads(p.read_text()) for p in sorted(directory.glob("serving-*-c*-run*.json"))]
    return [d for d in offline if "results" in d], [d for d in serving if "metrics" in d]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tessera.bench.report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["demo-vl", "bench-medium"])
    ap.add_argument("--num-runs", type=int, default=3)
    ap.add_argument("--serving-model", default="demo-vl")
    ap.add_argument("--serving-prompts", type=int, default=64)
    ap.add_argument("--serving-output-len", type=int, default=32)
    ap.add_argument("--no-serving", action="store_true")
    ap.add_argument("--output-dir", default=None, help="where result JSONs and the plot go (default: a temp dir)")
    ap.add_argument("--from-json", default=None, metavar="DIR", help="render from the JSONs in DIR; run nothing")
    ap.add_argument("--doc", default=str(DEFAULT_DOC))
    ns = ap.parse_args(argv)
    if ns.from_json:
        out_dir = Path(ns.from_json)
    else:
        from tessera.bench.offline import OfflineConfig, format_summary, run_offline

        out_dir = Path(ns.output_dir or tempfile.mkdtemp(prefix="tessera-bench-"))
        out_dir.mkdir(parents=True, exist_ok=True)
        for model in ns.models:
            result = run_offline(OfflineConfig(model_path=model, num_runs=ns.num_runs))
            print(format_summary(result), flush=True)
            (out_dir / f"offline-{Path(model).name}.json").write_text(json.dumps(result, indent=2))
        if not ns.no_serving:
            paths = run_serving_sweep(ns.serving_model, out_dir, ns.num_runs, ns.serving_prompts,
                                      ns.serving_output_len)
            from tessera.bench.plot import load_results, plot_latency_vs_concurrency

            print(plot_latency_vs_concurrency(load_results([str(p) for p in paths]), str(out_dir / "latency.png")))
    offline, serving = load_dir(out_dir)
    update_doc(Path(ns.doc), render(offline, serving))
    print(f"results in {out_dir}; tables written to {ns.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
