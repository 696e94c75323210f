"""Weight-only quantization on one checkpoint: batch-1 decode ms/token, prefill tok/s and greedy agreement
with float32, per --torchao-config format (docs/benchmarks.md, "Weight-only int8 / int4").

    python -m tessera.bench.quant [--model-path DIR] [--formats fp32,int8wo,int4wo-32,int4wo-128]

Formats: fp32, a --torchao-config name, or a 16-bit one: bfloat16 / float16 (--dtype; a bf16 model's prefill
products in bf16 where the CPU has them) and bfloat16-f32 (TESSERA_BF16_COMPUTE=0: float32 products).

Default model: bench-medium (tessera.bench.medium). Rounds alternate the formats (one Engine per format
per round, so a slow spell of a shared machine hits each alike); figures are medians over the rounds.
Decode: (T(prompt + n tokens) - T(prompt + 1 token)) / (n - 1), so prefill and per-call costs cancel;
prefill: prompt tokens / T(prompt + 1 token), caches flushed before every call.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from tessera.bench.agreement import GreedyOutput, agreement
from tessera.bench.cli import report_result
from tessera.platform.launch import environment


def _cpu_seconds(engine) -> float:
    """CPU time of the engine's scheduler processes (the model runs there) so far (Linux; 0 elsewhere)."""
    total = 0
    for proc in engine.tokenizer_manager._procs:
        try:
            fields = open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            return 0.0
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def _timed(engine, ids: list[int], n: int) -> tuple[float, float]:
    """(wall, scheduler CPU) seconds for one request of n output tokens from empty caches."""
    engine.flush_cache()
    t0, c0 = time.perf_counter(), _cpu_seconds(engine)
    out = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": n, "ignore_eos": True})
    seconds, cpu = time.perf_counter() - t0, _cpu_seconds(engine) - c0
    if out["meta_info"]["completion_tokens"] != n:
        raise RuntimeError(f"got {out['meta_info']['completion_tokens']} tokens, expected {n}")
    return seconds, cpu


def measure(engine, prompt: list[int], n: int, repeats: int) -> dict[str, float]:
    """Batch-1 decode ms/token and prefill tok/s, medians of `repeats` interleaved pairs, in wall time and
    in the scheduler's CPU time (on a machine shared with other work, the second is what one thread's
    compute costs: time-sliced waits are not in it)."""
    _timed(engine, prompt, 2)  # untimed warm-up
    ones, ns = [], []
    for _ in range(repeats):
        ones.append(_timed(engine, prompt, 1))
        ns.append(_timed(engine, prompt, n))
    out = {}
    for i, kind in enumerate(("wall", "cpu")):
        t1, tn = statistics.median(t[i] for t in ones), statistics.median(t[i] for t in ns)
        out[f"decode_ms_{kind}"] = (tn - t1) / (n - 1) * 1000
        out[f"prefill_tok_s_{kind}"] = len(prompt) / t1
    return out


def greedy(engine, prompts: list[list[int]], n: int) -> list[GreedyOutput]:
    params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    return [GreedyOutput(o["output_ids"]) for o in engine.generate(input_ids=prompts, sampling_params=params)]


def engine_settings(fmt: str) -> tuple[dict, dict[str, str]]:
    """(Engine kwargs, environment for its scheduler process) of one format name."""
    if fmt == "fp32":
        return {"dtype": "float32"}, {}
    if fmt in ("bfloat16", "float16"):
        return {"dtype": fmt}, {}
    if fmt == "bfloat16-f32":
        return {"dtype": "bfloat16"}, {"TESSERA_BF16_COMPUTE": "0"}
    return {"torchao_config": fmt}, {}


def run(model_path: str, formats: list[str], rounds: int, threads: int, prompt_len: int, decode_tokens: int,
        agreement_prompts: int, agreement_tokens: int, log=print) -> dict:
    from tessera.entrypoints.engine import Engine
    from tessera.models.config import ModelConfig

    rng = random.Random(0)
    # Random ids past the special tokens (demo-vl's tokenizer, which bench-medium shares, has 10 at 0..9).
    vocab = ModelConfig.load(model_path).vocab_size
    prompt = [rng.randrange(10, vocab) for _ in range(prompt_len)]
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randrange(16, 128))] for _ in range(agreement_prompts)]
    figures: dict[str, dict] = {f: {} for f in formats}
    outputs: dict[str, list[GreedyOutput]] = {}
    for r in range(rounds):
        for fmt in formats:
            kwargs, env = engine_settings(fmt)
            with environment(env), Engine(model_path=model_path, cpu_threads=threads, max_total_tokens=8192,
                                           show_progress=False, **kwargs) as engine:
                got = measure(engine, prompt, decode_tokens, 3)
                for key, value in got.items():
                    figures[fmt].setdefault(key, []).append(value)
                if r == 0:
                    effective = engine.get_server_info()["effective"]
                    quantization = effective.get("quantization") or effective.get("linear_kernel", "")
                    outputs[fmt] = greedy(engine, prompts, agreement_tokens)
                    figures[fmt]["quantization"] = quantization
            log(f"round {r + 1} {fmt}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items()))
    result = {"model_path": model_path, "threads": threads, "prompt_len": prompt_len, "rounds": rounds, "formats": {}}
    for fmt, f in figures.items():
        entry: dict = {"quantization": f.pop("quantization")}
        entry.update({k: round(statistics.median(v), 2) for k, v in f.items()})
        entry["runs"] = {k: [round(x, 2) for x in v] for k, v in f.items()}
        if "fp32" in outputs and fmt != "fp32":
            agree = agreement(outputs[fmt], outputs["fp32"])
            entry["agreement_with_fp32"] = {k: agree[k] for k in agree if not isinstance(agree[k], list)}
        result["formats"][fmt] = entry
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="bench-medium", help="a checkpoint dir, demo-vl or bench-medium")
    ap.add_argument("--formats", default="fp32,int8wo,int4wo-32,int4wo-128")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=65)
    ap.add_argument("--agreement-prompts", type=int, default=16)
    ap.add_argument("--agreement-tokens", type=int, default=64)
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args()
    from tessera.bench.medium import resolve_bench_model

    result = run(resolve_bench_model(args.model_path), args.formats.split(","), args.rounds, args.threads, args.prompt_len,
                 args.decode_tokens, args.agreement_prompts, args.agreement_tokens)
    report_result(json.dumps(result, indent=2), result, args.output_json)


if __name__ == "__main__":
    main()
