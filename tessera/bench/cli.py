"""`tessera bench serving | offline`: argument parsing and dispatch (the work lives in serving.py and offline.py)."""

from __future__ import annotations

import argparse
import json
import math

from tessera.bench.datasets import OFFLINE_WORKLOADS, SERVING_DATASETS


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"request_rate: expected a number or inf, got {text!r}") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"request_rate: must be positive (or inf), got {text!r}")
    return rate


def report_result(summary: str, result: dict, output_json: str | None) -> None:
    """A command's summary on stdout, and its full result as JSON at --output-json when given."""
    print(summary)
    if output_json:
        with open(output_json, "w") as f:
            json.dump(result, f, indent=2)


def _json_obj(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _subcommand(sub, name: str, func, *, help: str, description: str, model_path: str | None = None,
                model_help: str = "checkpoint dir, demo-vl, or bench-medium (~150M random)",
                output_help: str = "write the whole result here as JSON") -> argparse.ArgumentParser:
    """`tessera bench NAME`, run by func(namespace), with what every subcommand takes: --output-json, and
    --model-path (default model_path) for those that load a model."""
    p = sub.add_parser(name, help=help, description=description)
    if model_path is not None:
        p.add_argument("--model-path", default=model_path, help=model_help)
    p.add_argument("--output-json", default=None, help=output_help)
    p.set_defaults(func=func)
    return p


def _add_serving(sub) -> None:
    p = _subcommand(sub, "serving", _cmd_serving,
                    output_help="write the result (config, metrics, per-request) here",
                    help="load-test an OpenAI-compatible server (streaming, Poisson arrivals)",
                    description="Drives any OpenAI-compatible /v1/chat/completions server with multimodal "
                                "requests and reports throughput and TTFT/TPOT/ITL/E2E percentiles.")
    p.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:30000 (with or without /v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the first one the server lists)")
    p.add_argument("--dataset", default="random-image", choices=SERVING_DATASETS,
                   help="random-image | random-video | scenes | random-audio (for audio models, e.g. demo-asr)")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=_rate, default=math.inf, help="requests/s, Poisson arrivals (default inf)")
    p.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight (default: no cap)")
    p.add_argument("--image-resolution", default="448x448", help="WxH or random:MIN-MAX (random-image/-video)")
    p.add_argument("--image-count", type=int, default=1, help="images per request (random-image, scenes)")
    p.add_argument("--video-frames", type=int, default=8, help="frames per video (random-video)")
    p.add_argument("--audio-seconds", type=float, default=4.0, help="clip length (random-audio)")
    p.add_argument("--input-len", type=int, default=32, help="random words of text per request (random-*)")
    p.add_argument("--output-len", type=int, default=128, help="output tokens per request")
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="do not send ignore_eos/min_tokens (for servers that reject them); lengths then vary")
    p.add_argument("--extra-body", type=_json_obj, default={}, help="JSON merged into every request body")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default="none")
    p.add_argument("--num-warmup", type=int, default=1, help="untimed requests before the run")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--server-pid", type=int, default=None,
                   help="sample this process tree's RSS during the run (default: whoever listens on --base-url's "
                        "port, when it is on this machine; 0: none)")
    p.add_argument("--plot", default=None, help="PNG of latency percentiles vs concurrency (needs --from-json)")
    p.add_argument("--from-json", nargs="+", default=None, help="result files to plot instead of running")


def _cmd_serving(ns: argparse.Namespace) -> int:
    if ns.from_json or ns.plot:
        if not (ns.from_json and ns.plot):
            raise ValueError("plot: --plot FILE.png and --from-json a.json b.json ... go together")
        from tessera.bench.plot import load_results, plot_latency_vs_concurrency

        print(plot_latency_vs_concurrency(load_results(ns.from_json), ns.plot))
        return 0
    if not ns.base_url:
        raise ValueError("base_url: --base-url is required to run the benchmark (e.g. http://127.0.0.1:30000)")
    from tessera.bench.datasets import make_serving_dataset
    from tessera.bench.serving import ServingConfig, run_serving

    make_serving_dataset(ns.dataset, 1, image_resolution=ns.image_resolution, image_count=ns.image_count,
                         audio_seconds=ns.audio_seconds)  # bad options fail before connecting to anything
    cfg = ServingConfig(
        base_url=ns.base_url, model=ns.model, dataset=ns.dataset, num_prompts=ns.num_prompts,
        request_rate=ns.request_rate, max_concurrency=ns.max_concurrency, image_resolution=ns.image_resolution,
        image_count=ns.image_count, output_len=ns.output_len, input_len=ns.input_len, video_frames=ns.video_frames,
        audio_seconds=ns.audio_seconds,
        seed=ns.seed, ignore_eos=not ns.no_ignore_eos, temperature=ns.temperature, api_key=ns.api_key,
        timeout_s=ns.timeout, num_warmup=ns.num_warmup, disable_tqdm=ns.disable_tqdm, extra_body=ns.extra_body,
        server_pid=ns.server_pid)
    result = run_serving(cfg, ns.output_json)
    return 0 if result["metrics"]["num_completed"] > 0 else 1


def _add_offline(sub) -> None:
    p = _subcommand(sub, "offline", _cmd_offline, model_path="demo-vl",
                    help="workloads a-d through tessera.Engine and HF transformers generate",
                    description="Runs workloads a-d (see tessera/bench/offline.py) through tessera.Engine and, "
                                "with --compare hf, through HF transformers' batched generate in this process.")
    p.add_argument("--workload", default="all", help="a, b, c, d, a comma list, or all")
    p.add_argument("--compare", default="hf", choices=("hf", "none"), help="baseline to compare with")
    p.add_argument("--num-runs", type=int, default=3, help="timed runs per figure; the median is reported")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-output-len", type=int, default=None, help="cap every output length (quick runs)")
    p.add_argument("--decode-len", type=int, default=64, help="output tokens for workload d")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="both sides' dtype (Tessera's engine, HF's from_pretrained); auto: the checkpoint's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-args", type=_json_obj, default={},
                   help='extra tessera.Engine/ServerArgs fields as JSON, e.g. \'{"max_running_requests": 32}\'')


def parse_workloads(text: str) -> tuple[str, ...]:
    if text.strip() == "all":
        return OFFLINE_WORKLOADS
    names = tuple(dict.fromkeys(w.strip() for w in text.split(",") if w.strip()))
    bad = [w for w in names if w not in OFFLINE_WORKLOADS]
    if bad or not names:
        raise ValueError(f"workload: expected a, b, c, d, a comma list of them, or all; got {text!r}")
    return names


def _cmd_offline(ns: argparse.Namespace) -> int:
    from tessera.bench.offline import OfflineConfig, format_summary, run_offline

    cfg = OfflineConfig(model_path=ns.model_path, workloads=parse_workloads(ns.workload),
                        compare_hf=ns.compare == "hf", num_runs=ns.num_runs, seed=ns.seed,
                        num_requests=ns.num_requests, max_output_len=ns.max_output_len, decode_len=ns.decode_len,
                        hf_batch_size=ns.hf_batch_size, engine_args=ns.engine_args, dtype=ns.dtype)
    result = run_offline(cfg)
    report_result(format_summary(result), result, ns.output_json)
    return 0


def _add_profile(sub) -> None:
    p = _subcommand(sub, "profile", _cmd_profile, model_path="demo-vl",
                    help="one decode step of our model vs HF's, with torch.profiler's op table",
                    description="Times a decode step of Tessera's model over a paged KV pool and of HF's "
                                "model with its DynamicCache, same batch and context, and groups Tessera's "
                                "operators by self CPU time (see tessera/bench/step_profile.py).")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--context-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--disable-decode-kv-mirror", action="store_true",
                   help="gather every request's K/V from the pool each step, as before the mirror")


def _cmd_profile(ns: argparse.Namespace) -> int:
    import torch

    from tessera.bench.step_profile import ProfileConfig, format_profile, run_profile

    for name in ("batch_size", "context_len", "steps"):
        if getattr(ns, name) < 1:
            raise ValueError(f"{name}: must be a positive integer")
    if ns.threads:
        torch.set_num_threads(ns.threads)
    result = run_profile(ProfileConfig(model_path=ns.model_path, batch_size=ns.batch_size,
                                       context_len=ns.context_len, steps=ns.steps,
                                       no_mirror=ns.disable_decode_kv_mirror))
    report_result(format_profile(result), result, ns.output_json)
    return 0


def _add_soak(sub) -> None:
    p = _subcommand(sub, "soak", _cmd_soak,
                    model_path="demo-vl", model_help="model of the server started when --base-url is not given",
                    help="reliability under load: chat requests, a share of them hostile; checks 4xx "
                         "shapes, no 5xx, idle /metrics after the drain",
                    description="Sends --num-requests chat requests (scene questions about rendered images) at "
                                "--concurrency, --hostile-fraction of them hostile (corrupt/truncated media, "
                                "pixel bombs, bad schemes, private and metadata URLs, paths outside the "
                                "allowed directory, 50 images, huge prompts), and checks every answer. "
                                "Exit 1 if any check fails (see tessera/bench/soak.py).")
    p.add_argument("--base-url", default=None, help="a running server; without it one is started (--model-path)")
    p.add_argument("--num-requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--hostile-fraction", type=float, default=0.05)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--distinct-prompts", type=int, default=200,
                   help="different scene questions (each run alone first, for the answers to compare with)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--api-key", default=None)
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout in seconds")


def _cmd_soak(ns: argparse.Namespace) -> int:
    import contextlib
    import dataclasses
    import tempfile

    from tessera.bench.soak import SoakConfig, format_result, run_soak

    if not 0 <= ns.hostile_fraction <= 1 or ns.num_requests < 1 or ns.concurrency < 1:
        raise ValueError("soak: --num-requests and --concurrency must be positive, --hostile-fraction in [0, 1]")
    with contextlib.ExitStack() as stack:
        base_url = ns.base_url
        if base_url is None:
            from tessera.bench.report import LocalServer

            media_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="tessera-soak-"))
            server = stack.enter_context(LocalServer(ns.model_path, "--allowed-local-media-path", media_dir))
            base_url = server.base_url
        cfg = SoakConfig(base_url=base_url, num_requests=ns.num_requests, concurrency=ns.concurrency,
                         hostile_fraction=ns.hostile_fraction, max_tokens=ns.max_tokens, seed=ns.seed,
                         distinct_prompts=ns.distinct_prompts,
                         timeout_s=ns.timeout, api_key=ns.api_key)
        result = run_soak(cfg)
    report_result(format_result(result), dataclasses.asdict(result), ns.output_json)
    return 0 if result.ok else 1


def _add_overload(sub) -> None:
    p = _subcommand(sub, "overload", _cmd_overload, model_path="demo-vl",
                    help="load past capacity against --max-queued-requests: 503s only, nothing "
                         "admitted lost, admitted latency",
                    description="Streams chat requests from load-factor x (running + queued) clients for "
                                "--duration seconds (after a --baseline at load factor 1) and checks that "
                                "refusals are 503s counted in /metrics and that every admitted request "
                                "finishes. Exit 1 if a check fails (see tessera/bench/overload.py).")
    p.add_argument("--base-url", default=None, help="a running server started with the same two flags; without "
                                                    "it one is started (--model-path)")
    p.add_argument("--max-running-requests", type=int, default=16)
    p.add_argument("--max-queued-requests", type=int, default=32)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of overload")
    p.add_argument("--load-factor", type=float, default=4.0, help="clients per unit of capacity")
    p.add_argument("--baseline", type=float, default=30.0, help="seconds at load factor 1 first (0: none)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--retry-wait", type=float, default=0.25, help="seconds a refused client waits")
    p.add_argument("--api-key", default=None)


def _cmd_overload(ns: argparse.Namespace) -> int:
    import contextlib

    from tessera.bench.overload import OverloadConfig, format_result, run_overload

    if min(ns.max_running_requests, ns.max_queued_requests + 1, ns.max_tokens) < 1 or ns.duration <= 0 \
            or ns.load_factor <= 0 or ns.baseline < 0 or ns.retry_wait < 0:
        raise ValueError("overload: sizes and --duration must be positive, --baseline and --retry-wait >= 0")
    with contextlib.ExitStack() as stack:
        base_url = ns.base_url
        if base_url is None:
            from tessera.bench.report import LocalServer

            server = stack.enter_context(LocalServer(
                ns.model_path, "--max-running-requests", str(ns.max_running_requests),
                "--max-queued-requests", str(ns.max_queued_requests)))
            base_url = server.base_url
        result = run_overload(OverloadConfig(
            base_url=base_url, max_running=ns.max_running_requests, max_queued=ns.max_queued_requests,
            duration_s=ns.duration, load_factor=ns.load_factor, baseline_s=ns.baseline, max_tokens=ns.max_tokens,
            retry_wait_s=ns.retry_wait, api_key=ns.api_key))
    report_result(format_result(result), result, ns.output_json)
    return 0 if result["ok"] else 1


def _add_spec(sub) -> None:
    p = _subcommand(sub, "spec", _cmd_spec,
                    model_path="bench-medium", model_help="checkpoint dir, demo-vl, or bench-medium",
                    help="output tok/s with and without speculative decoding, side by side",
                    description="Two engines over one checkpoint, plain and speculative, timed in alternation "
                                "at each concurrency; outputs compared token by token "
                                "(see tessera/bench/speculative.py).")
    p.add_argument("--algorithm", default="ORACLE", choices=("ORACLE", "NGRAM", "STANDALONE"))
    p.add_argument("--draft-model-path", default=None, help="STANDALONE's draft checkpoint")
    p.add_argument("--num-steps", type=int, default=4, help="draft tokens per verify step")
    p.add_argument("--dataset", default="random", choices=("random", "scenes", "copy"))
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens (random)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--concurrency", default="1,16", help="comma list of requests in flight")
    p.add_argument("--num-runs", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-args", type=_json_obj, default={}, help="extra Engine/ServerArgs fields as JSON")


def _cmd_spec(ns: argparse.Namespace) -> int:
    from tessera.bench.speculative import SpecBenchConfig, format_summary, run_spec_bench

    concurrency = tuple(int(c) for c in ns.concurrency.split(",") if c.strip())
    if not concurrency or min(concurrency) < 1 or min(ns.num_prompts, ns.num_runs, ns.output_len) < 1:
        raise ValueError("spec: --concurrency, --num-prompts, --num-runs and --output-len must be positive")
    cfg = SpecBenchConfig(model_path=ns.model_path, algorithm=ns.algorithm, draft_model_path=ns.draft_model_path,
                          num_steps=ns.num_steps, dataset=ns.dataset, num_prompts=ns.num_prompts,
                          input_len=ns.input_len, output_len=ns.output_len, concurrency=concurrency,
                          num_runs=ns.num_runs, seed=ns.seed, engine_args=ns.engine_args)
    result = run_spec_bench(cfg)
    report_result(format_summary(result), result, ns.output_json)
    return 0 if all(r["identical"] for r in result["by_concurrency"].values()) else 1


def _add_embed(sub) -> None:
    p = _subcommand(sub, "embed", _cmd_embed, model_path="demo-vl",
                    help="embeddings/s of Engine.encode vs transformers' forward (texts and images)",
                    description="Embeds --num-texts scene captions and --num-images rendered scenes through "
                                "tessera.Engine.encode and through transformers' base model (one input per "
                                "forward, and padded batches), in one run (see tessera/bench/embed.py).")
    p.add_argument("--num-texts", type=int, default=256)
    p.add_argument("--num-images", type=int, default=64)
    p.add_argument("--hf-batch-size", type=int, default=32)


def _cmd_embed(ns: argparse.Namespace) -> int:
    from tessera.bench.embed import run_embed_bench

    if min(ns.num_texts, ns.num_images, ns.hf_batch_size) < 1:
        raise ValueError("embed: --num-texts, --num-images and --hf-batch-size must be positive")
    result = run_embed_bench(ns.model_path, ns.num_texts, ns.num_images, ns.hf_batch_size)
    report_result(result.summary(), result.as_dict(), ns.output_json)
    return 0


SUBCOMMANDS = {"serving": _add_serving, "offline": _add_offline, "profile": _add_profile, "soak": _add_soak,
               "overload": _add_overload, "spec": _add_spec, "embed": _add_embed}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tessera bench", description="Tessera benchmarks")
    sub = p.add_subparsers(dest="bench", required=True)
    for add in SUBCOMMANDS.values():
        add(sub)
    return p


def run_bench(argv: list[str]) -> int:
    """Entry point of `tessera bench ...`; ValueErrors reach tessera.cli as one-line user errors."""
    ns = build_parser().parse_args(argv)
    return ns.func(ns)
