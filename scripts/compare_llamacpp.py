"""Tessera beside llama.cpp on this machine's cores: batch-1 prefill and decode, and serving with images.

    python scripts/compare_llamacpp.py [--root /work/llamacpp] [--threads 2] [--reps 3]
        [--tessera-args "--dtype bfloat16"] [--sections micro,serving] [--out-json F] [--out-md F]
        [--micro-variants "F32=;F16=--dtype bfloat16;Q8_0=--torchao-config int8wo;Q4_0=--torchao-config int4wo-32"]

Not part of `make test`. Steps, each skipped when its output exists:
1. scripts/build_llamacpp.sh builds llama-bench, llama-server and llama-quantize from llama-cpp-python's
   source distribution on PyPI (its vendored llama.cpp).
2. demo-vl and bench-medium are converted by the vendored convert_hf_to_gguf.py (scripts/llamacpp_convert.py:
   demo-vl's pre-tokenizer is mapped to gpt-2 at run time), the text model in F32 and quantized by
   llama-quantize to F16, Q8_0 and Q4_0; the vision tower (mmproj) in F32.
3. micro (bench-medium): llama-bench, weights read into memory (no mmap: mapped weights were paged out
   here and the figures swung 10x), `-p 256` for prefill and `-n 64` at depth 256 for decode, against one
   Tessera server's /generate on 256 random prompt tokens (see tessera_micro). Engines alternate, each
   figure is the median of --reps.
4. serving: llama-server (`--parallel N -c C -lm none --image-min-tokens 64 --image-max-tokens 64`) and
   `tessera serve --max-total-tokens C` (the same KV capacity; Tessera's default thread policy, see
   --serving-threads), both on the same --threads cores, a fresh server per run, engines
   alternating, both driven by `tessera bench serving` (which also samples the server's peak RSS);
   medians of --reps.
Figures are printed as a markdown table (and written to --out-md / --out-json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
QUANTS = ("F16", "Q8_0", "Q4_0")
# (name, model, dataset, extra client args, concurrency, prompts)
SERVING = (("demo-vl scenes", "demo-vl", "scenes", [], 16, 256),
           ("bench-medium 448x448 random images", "bench-medium", "random-image", ["--image-resolution", "448x448"],
            8, 32))


def log(msg: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    log(" ".join(shlex.quote(str(c)) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, text=True, **kw)


def model_dir(name: str) -> Path:
    from tessera.bench.medium import resolve_bench_model

    return Path(resolve_bench_model(name))


# ---------------------------------------------------------------- build and convert


def build(root: Path) -> Path:
    env = {**os.environ, "PYTHON": sys.executable}
    run(["bash", REPO / "scripts" / "build_llamacpp.sh", root], env=env)
    return root / "build" / "bin"


def convert(root: Path, bin_dir: Path, name: str) -> dict[str, Path]:
    """{F32, F16, Q8_0, Q4_0, mmproj}: the GGUF files of one model."""
    out = root / "models"
    out.mkdir(parents=True, exist_ok=True)
    files = {"F32": out / f"{name}-f32.gguf", "mmproj": out / f"{name}-mmproj-f32.gguf"}
    converter = [sys.executable, REPO / "scripts" / "llamacpp_convert.py", root / "llama.cpp", model_dir(name)]
    if not files["F32"].exists():
        run([*converter, "--outtype", "f32", "--outfile", files["F32"]])
    if not files["mmproj"].exists():
        run([*converter, "--mmproj", "--outtype", "f32", "--outfile", files["mmproj"]])
    for q in QUANTS:
        files[q] = out / f"{name}-{q.lower()}.gguf"
        if not files[q].exists():
            run([bin_dir / "llama-quantize", files["F32"], files[q], q], stdout=subprocess.DEVNULL)
    return files


# ---------------------------------------------------------------- servers


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready ({url})")
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not ready after {timeout_s} s ({url})")


class Server:
    """A server process for the duration of a with-block; its output goes to a log file."""

    def __init__(self, cmd: list, port: int, log_path: Path):
        self.cmd, self.port, self.log_path = [str(c) for c in cmd], port, log_path
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self) -> Server:
        log(" ".join(shlex.quote(c) for c in self.cmd) + f"  > {self.log_path}")
        self.log_file = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log_file, stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})
        try:
            wait_ready(self.url, self.proc)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        from tessera.platform.launch import stop_processes

        stop_processes([self.proc], timeout_s=30)
        self.log_file.close()


def pinned(ns: argparse.Namespace) -> list:
    """`taskset` onto the first --threads cores when the machine has more: both servers and all their processes
    then share the same cores (llama-server's threads, Tessera's frontend and scheduler)."""
    from tessera.platform.threads import available_cores

    return [] if ns.threads >= available_cores() else ["taskset", "-c", f"0-{ns.threads - 1}"]


def tessera_cmd(model: str, port: int, ns: argparse.Namespace, extra: list[str] = (), fixed: bool = True) -> list:
    """fixed: `--cpu-threads --threads`, as llama-bench's `-t` (micro, and serving with --serving-threads fixed).
    Otherwise Tessera's default thread policy (platform/threads.py: the model takes the cores its frontend and
    the client leave, at most --threads of them under `pinned`): a fixed count keeps spinning on cores the
    frontend needs (see docs/benchmarks.md, "Serving on the cores the frontend leaves")."""
    threads = ["--cpu-threads", ns.threads] if fixed else []
    return [*pinned(ns), sys.executable, "-m", "tessera", "serve", "--model-path", str(model_dir(model)),
            "--port", port, *threads, *extra, *shlex.split(ns.tessera_args)]


def llama_server_cmd(bin_dir: Path, files: dict[str, Path], port: int, ns: argparse.Namespace,
                     parallel: int) -> list:
    return [*pinned(ns), bin_dir / "llama-server", "-m", files[ns.llama_quant], "--mmproj", files["mmproj"],
            "--port", port, "-t", ns.threads, "-tb", ns.threads, "--parallel", parallel, "-c", ns.context,
            "-lm", "none", "--image-min-tokens", 64, "--image-max-tokens", 64, "--no-webui"]


# ---------------------------------------------------------------- micro: batch-1 prefill and decode


def llama_bench(bin_dir: Path, gguf: Path, ns: argparse.Namespace) -> tuple[float, float]:
    """(prefill tok/s at 256 tokens, decode ms/token at depth 256)."""
    common = [bin_dir / "llama-bench", "-m", gguf, "-t", ns.threads, "-r", 1, "-o", "json", *ns.llama_bench_load]
    pp = json.loads(run([*common, "-p", 256, "-n", 0], capture_output=True).stdout)
    tg = json.loads(run([*common, "-p", 0, "-n", 64, "-d", 256], capture_output=True).stdout)
    return pp[0]["avg_ts"], 1000 / tg[0]["avg_ts"]


def post_json(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def tessera_micro(url: str, rng: random.Random) -> tuple[float, float]:
    """(prefill tok/s, decode ms/token) from two 256-token prompts (random ids: nothing is cached), one with 1
    output token, one with 65: (e2e(65) - e2e(1)) / 64, as llama-bench's decode at depth 256. (A non-streamed
    request's TTFT is its e2e: the frontend sees its tokens at the end.)"""
    def e2e(n: int) -> float:
        ids = [rng.randrange(10, 500) for _ in range(256)]
        params = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
        return post_json(url + "/generate", {"input_ids": ids, "sampling_params": params})["meta_info"]["e2e_latency"]

    t1, t65 = e2e(1), e2e(65)
    return 256 / t1, (t65 - t1) / 64 * 1000


def micro(bin_dir: Path, files: dict[str, Path], ns: argparse.Namespace) -> dict:
    """One Tessera server per --micro-variants entry, all started before the first measurement (each idles,
    blocked on its sockets, while another engine runs); every rep runs llama-bench on every GGUF, then each
    Tessera variant."""
    llama: dict[str, list[tuple[float, float]]] = {q: [] for q in ("F32", *QUANTS)}
    tessera: dict[str, list[tuple[float, float]]] = {q: [] for q in ns.micro_variants}
    rng = random.Random(0)
    with contextlib.ExitStack() as stack:
        servers = {}
        for i, (quant, flags) in enumerate(ns.micro_variants.items()):
            cmd = tessera_cmd("bench-medium", ns.port + i, ns, ["--max-total-tokens", ns.context, *shlex.split(flags)])
            servers[quant] = stack.enter_context(Server(cmd, ns.port + i, ns.logs / f"tessera-micro-{quant}.log"))
            tessera_micro(servers[quant].url, rng)  # warm-up: first-call allocations
        for rep in range(ns.reps):
            for q in llama:
                llama[q].append(llama_bench(bin_dir, files[q], ns))
            for quant, srv in servers.items():
                tessera[quant].append(tessera_micro(srv.url, rng))
            log(f"micro rep {rep}: llama.cpp {[llama[q][-1] for q in llama]}, tessera {tessera}")

    def med(xs: list[tuple[float, float]]) -> dict:
        return {"prefill_tok_s": statistics.median(x[0] for x in xs), "decode_ms": statistics.median(x[1] for x in xs)}

    return {"llama.cpp": {q: med(v) for q, v in llama.items()}, "tessera": {q: med(v) for q, v in tessera.items()},
            "tessera_flags": ns.micro_variants, "reps": ns.reps}


# ---------------------------------------------------------------- serving


class FailedRequests(RuntimeError):
    """A serving run in which some requests failed: its figures are not comparable."""


RUN_ATTEMPTS = 3  # a run with failed requests is repeated on a fresh server (llama-server dropped a connection
# now and then at concurrency 16); the repeats are counted in the result


def bench_serving(url: str, dataset: str, extra: list[str], concurrency: int, prompts: int, out: Path,
                  ns: argparse.Namespace) -> dict:
    run([sys.executable, "-m", "tessera", "bench", "serving", "--base-url", url, "--dataset", dataset, *extra,
         "--num-prompts", prompts, "--max-concurrency", concurrency, "--output-len", ns.output_len,
         "--disable-tqdm", "--output-json", out], env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    m = result["metrics"]
    if m["num_failed"]:
        raise FailedRequests(f"{m['num_failed']} failed requests ({out}): {m['errors']}")
    mem = result["server_memory"] or {}
    return {"output_tok_s": m["output_throughput"], "ttft_p99_ms": m["ttft_ms"]["p99"],
            "ttft_median_ms": m["ttft_ms"]["median"], "peak_rss_mib": mem.get("peak_rss_mib"),
            "end_rss_mib": mem.get("end_rss_mib"), "end_pss_mib": mem.get("end_pss_mib"),
            "processes": {p["name"]: p["peak_rss_mib"] for p in mem.get("processes", [])}}


def serving(bin_dir: Path, all_files: dict[str, dict[str, Path]], ns: argparse.Namespace) -> dict:
    res: dict = {}
    for title, model, dataset, extra, conc, prompts in SERVING:
        runs: dict[str, list[dict]] = {"llama.cpp": [], "tessera": []}
        repeated = {"llama.cpp": 0, "tessera": 0}
        for rep in range(ns.reps):
            for engine in ("llama.cpp", "tessera") if rep % 2 == 0 else ("tessera", "llama.cpp"):
                tag = f"{model}-{engine}-{rep}"
                cmd = (llama_server_cmd(bin_dir, all_files[model], ns.port, ns, conc) if engine == "llama.cpp"
                       else tessera_cmd(model, ns.port, ns, ["--max-total-tokens", ns.context],
                                        fixed=ns.serving_threads == "fixed"))
                for attempt in range(RUN_ATTEMPTS):
                    try:
                        with Server(cmd, ns.port, ns.logs / f"{tag}-{attempt}.log") as srv:
                            runs[engine].append(bench_serving(srv.url, dataset, extra, conc,
                                                              prompts // ns.prompts_divisor,
                                                              ns.logs / f"{tag}-{attempt}.json", ns))
                        break
                    except FailedRequests as e:
                        if attempt == RUN_ATTEMPTS - 1:
                            raise
                        repeated[engine] += 1
                        log(f"{title} rep {rep} {engine}: {e}; repeating the run on a fresh server")
                log(f"{title} rep {rep} {engine}: {runs[engine][-1]}")
        res[title] = {"concurrency": conc, "prompts": prompts // ns.prompts_divisor, "repeated_runs": repeated,
                      **{e: {k: statistics.median(r[k] for r in rs) for k in rs[0]
                            if k != "processes" and all(r[k] is not None for r in rs)}
                         | {"processes": rs[-1]["processes"]} for e, rs in runs.items()}}
    return res


# ---------------------------------------------------------------- report


def table(result: dict) -> str:
    label = f"Tessera `{result['tessera_args']}`" if result["tessera_args"] else "Tessera"
    rows = [f"| | llama.cpp | {label} | Tessera ÷ llama.cpp |", "|---|---|---|---|"]
    if "micro" in result:
        mi = result["micro"]
        for quant, t in mi["tessera"].items():
            lf, flags = mi["llama.cpp"][quant], mi["tessera_flags"][quant] or "float32"
            rows.append(f"| bench-medium batch-1 decode, llama.cpp {quant} vs Tessera `{flags}` (depth 256) | "
                        f"{lf['decode_ms']:.1f} ms/token | {t['decode_ms']:.1f} ms/token | "
                        f"{t['decode_ms'] / lf['decode_ms']:.2f}x the time |")
            rows.append(f"| bench-medium prefill 256 tokens, llama.cpp {quant} vs Tessera `{flags}` | "
                        f"{lf['prefill_tok_s']:,.0f} tok/s | {t['prefill_tok_s']:,.0f} tok/s | "
                        f"{t['prefill_tok_s'] / lf['prefill_tok_s']:.2f} |")
    for title, r in result.get("serving", {}).items():
        lc, t = r["llama.cpp"], r["tessera"]
        rows.append(f"| {title}, {r['prompts']} prompts, concurrency {r['concurrency']}: output tok/s | "
                    f"{lc['output_tok_s']:.0f} | {t['output_tok_s']:.0f} | "
                    f"{t['output_tok_s'] / lc['output_tok_s']:.2f} |")
        rows.append(f"| same, TTFT p99 | {lc['ttft_p99_ms']:,.0f} ms | {t['ttft_p99_ms']:,.0f} ms | "
                    f"{t['ttft_p99_ms'] / lc['ttft_p99_ms']:.2f} |")
        if lc.get("peak_rss_mib") and t.get("peak_rss_mib"):
            parts = " + ".join(f"{n.rsplit('.', 1)[-1]} {v:,.0f}" for n, v in t["processes"].items())
            rows.append(f"| same, peak RSS of the server | {lc['peak_rss_mib']:,.0f} MiB | "
                        f"{t['peak_rss_mib']:,.0f} MiB ({parts}) | {t['peak_rss_mib'] / lc['peak_rss_mib']:.2f}x |")
        if lc.get("end_pss_mib") and t.get("end_pss_mib"):
            rows.append(f"| same, RSS / PSS at the end (PSS counts pages shared by processes once) | "
                        f"{lc['end_rss_mib']:,.0f} / {lc['end_pss_mib']:,.0f} MiB | "
                        f"{t['end_rss_mib']:,.0f} / {t['end_pss_mib']:,.0f} MiB | "
                        f"{t['end_pss_mib'] / lc['end_pss_mib']:.2f}x (PSS) |")
        rep = r.get("repeated_runs", {})
        if any(rep.values()):
            rows.append(f"| same, runs repeated after failed requests | {rep['llama.cpp']} | {rep['tessera']} | |")
    return "\n".join(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=Path(os.environ.get("LLAMACPP_ROOT", "/work/llamacpp")))
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--context", type=int, default=4096, help="KV capacity in tokens, both engines")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--port", type=int, default=31234)
    p.add_argument("--prompts-divisor", type=int, default=1, help="serving runs send 1/N of their prompts (quick runs)")
    p.add_argument("--sections", default="micro,serving")
    p.add_argument("--serving-threads", default="adaptive", choices=("adaptive", "fixed"),
                   help="Tessera's thread policy in the serving runs: its default (adaptive, within --threads cores) "
                        "or --cpu-threads --threads")
    p.add_argument("--tessera-args", default="", help='extra `tessera serve` flags, e.g. "--dtype bfloat16" or '
                                                     '"--torchao-config int8wo"')
    p.add_argument("--llama-quant", default="F32", choices=("F32", *QUANTS),
                   help="the llama.cpp weights the Tessera figures are compared with (F16 for bf16, Q8_0 for int8wo)")
    p.add_argument("--llama-bench-load", default="-lm none",
                   help="llama-bench's flags for how weights are loaded (none: read into memory, no mmap)")
    p.add_argument("--micro-variants", default="",
                   help='Tessera configurations for the micro section, each paired with the llama.cpp weights it is '
                        'compared with: "F32=;F16=--dtype bfloat16;Q8_0=--torchao-config int8wo;Q4_0=--torchao-config '
                        'int4wo-32" (default: --llama-quant with no extra flags)')
    p.add_argument("--out-json", type=Path, default=None)
    p.add_argument("--out-md", type=Path, default=None)
    ns = p.parse_args(argv)
    ns.llama_bench_load = shlex.split(ns.llama_bench_load)
    ns.sections = set(ns.sections.split(","))
    variants = [v.split("=", 1) for v in ns.micro_variants.split(";") if v.strip()] or [[ns.llama_quant, ""]]
    if any(len(v) != 2 or v[0].strip() not in ("F32", *QUANTS) for v in variants):
        p.error(f"--micro-variants: expected QUANT=FLAGS entries with QUANT in F32/{'/'.join(QUANTS)}, "
                f"got {ns.micro_variants!r}")
    ns.micro_variants = {q.strip(): flags.strip() for q, flags in variants}
    if not ns.sections <= {"micro", "serving"}:
        p.error(f"--sections: expected micro and/or serving, got {','.join(sorted(ns.sections))}")
    ns.logs = ns.root / "logs" / time.strftime("%Y%m%d-%H%M%S")
    ns.logs.mkdir(parents=True, exist_ok=True)
    return ns


def main(argv: list[str] | None = None) -> int:
    # SIGTERM unwinds like Ctrl-C, so the with-blocks stop the servers and subprocess.run kills llama-bench.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ns = parse_args(argv)
    bin_dir = build(ns.root)
    files = {name: convert(ns.root, bin_dir, name) for name in ("demo-vl", "bench-medium")}
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    result: dict = {"cpu": cpu, "cores": os.cpu_count(), "threads": ns.threads, "context": ns.context,
                    "tessera_args": ns.tessera_args, "llama_quant": ns.llama_quant,
                    "serving_threads": ns.serving_threads,
                    "load_average_start": os.getloadavg()}
    for section, run_section in (("micro", lambda: micro(bin_dir, files["bench-medium"], ns)),
                                 ("serving", lambda: serving(bin_dir, files, ns))):
        if section in ns.sections:
            result[section] = run_section()
            if ns.out_json:  # a section's figures survive a later one's failure
                ns.out_json.write_text(json.dumps(result, indent=2))
    result["load_average_end"] = os.getloadavg()
    md = table(result)
    print(md)
    if ns.out_md:
        ns.out_md.write_text(md + "\n")
    if ns.out_json:
        ns.out_json.write_text(json.dumps(result, indent=2))
    log(f"logs in {ns.logs}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
