"""Weight-only quantization on one checkpoint: batch-1 decode ms/token, prefill tok/s and greedy agreement
with float32, per --torchao-config format (docs/benchmarks.md, "Weight-only int8 / int4").

    python -m tessera.bench.quant [--model-path DIR] [--formats fp32,int8wo,int4wo-32,int4wo-128]

Default model: bench-medium (tessera.bench.medium). Rounds alternate the formats (one Engine per format
per round, so a slow spell of a shared machine hits each alike); figures are medians over the rounds.
Decode: (T(prompt + n tokens) - T(prompt + 1 token)) / (n - 1), so prefill and per-call costs cancel;
prefill: prompt tokens / T(prompt + 1 token), caches flushed before every call.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from tessera.bench.agreement import GreedyOutput, agreement
from tessera.demo.runs import report


def _timed(engine, ids: list[int], n: int) -> float:
    engine.flush_cache()
    t0 = time.perf_counter()
    out = engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": n, "ignore_eos": True})
    seconds = time.perf_counter() - t0
    if out["meta_info"]["completion_tokens"] != n:
        raise RuntimeError(f"got {out['meta_info']['completion_tokens']} tokens, expected {n}")
    return seconds


def measure(engine, prompt: list[int], n: int, repeats: int) -> tuple[float, float]:
    """(decode ms/token, prefill tok/s) at batch 1, medians of `repeats` interleaved pairs."""
    _timed(engine, prompt, 2)  # untimed warm-up
    t1s, tns = [], []
    for _ in range(repeats):
        t1s.append(_timed(engine, prompt, 1))
        tns.append(_timed(engine, prompt, n))
    t1, tn = statistics.median(t1s), statistics.median(tns)
    return (tn - t1) / (n - 1) * 1000, len(prompt) / t1


def greedy(engine, prompts: list[list[int]], n: int) -> list[GreedyOutput]:
    params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    return [GreedyOutput(o["output_ids"]) for o in engine.generate(input_ids=prompts, sampling_params=params)]


def run(model_path: str, formats: list[str], rounds: int, threads: int, prompt_len: int, decode_tokens: int,
        agreement_prompts: int, agreement_tokens: int, log=print) -> dict:
    from tessera.entrypoints.engine import Engine
    from tessera.models.config import ModelConfig

    rng = random.Random(0)
    # Random ids past the special tokens (demo-vl's tokenizer, which bench-medium shares, has 10 at 0..9).
    vocab = ModelConfig.load(model_path).vocab_size
    prompt = [rng.randrange(10, vocab) for _ in range(prompt_len)]
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randrange(16, 128))] for _ in range(agreement_prompts)]
    figures: dict[str, dict] = {f: {"decode_ms": [], "prefill_tok_s": []} for f in formats}
    outputs: dict[str, list[GreedyOutput]] = {}
    for r in range(rounds):
        for fmt in formats:
            with Engine(model_path=model_path, torchao_config="" if fmt == "fp32" else fmt, cpu_threads=threads,
                        max_total_tokens=8192, show_progress=False) as engine:
                decode_ms, prefill = measure(engine, prompt, decode_tokens, 3)
                figures[fmt]["decode_ms"].append(decode_ms)
                figures[fmt]["prefill_tok_s"].append(prefill)
                if r == 0:
                    figures[fmt]["quantization"] = engine.get_server_info()["effective"].get("quantization", "")
                    outputs[fmt] = greedy(engine, prompts, agreement_tokens)
            log(f"round {r + 1} {fmt}: decode {decode_ms:.2f} ms/token, prefill {prefill:.0f} tok/s")
    result = {"model_path": model_path, "threads": threads, "prompt_len": prompt_len, "rounds": rounds, "formats": {}}
    for fmt, f in figures.items():
        entry = {"decode_ms": round(statistics.median(f["decode_ms"]), 2),
                 "prefill_tok_s": round(statistics.median(f["prefill_tok_s"]), 1), "quantization": f["quantization"],
                 "runs": {k: [round(v, 2) for v in f[k]] for k in ("decode_ms", "prefill_tok_s")}}
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
    report(result, args.output_json)


if __name__ == "__main__":
    main()
