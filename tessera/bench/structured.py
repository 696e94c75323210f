"""Per-token cost of constrained decoding: the same batch decoded free and under a grammar, interleaved.

    python -m tessera.bench.structured [--model-path demo-vl] [--batch-sizes 1 32] [--tokens 64] [--repeats 5]

Every row decodes exactly --tokens tokens: free rows ignore EOS, constrained rows have a grammar far longer
than that (a regex of 1000 letters, or a JSON array of at least 1000 colors), so the two arms do the same
number of steps over the same prompt (prefilled once, then served from the prefix cache). Arms alternate
within each repeat (the machine is shared and noisy); the table gives medians of ms per decode step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

ARMS = {
    "free": {"ignore_eos": True},
    "regex": {"regex": "[a-z ]{1000}"},
    "json_schema": {"json_schema": json.dumps({"type": "array", "minItems": 1000, "items": {
        "enum": ["red", "green", "blue", "yellow", "purple", "orange"]}})},
}


def measure(engine, batch_size: int, tokens: int, repeats: int) -> dict[str, float]:
    prompt = engine.apply_chat_template([{"role": "user", "content": "Describe the image."}])
    engine.generate([prompt] * batch_size, {"max_new_tokens": 1})  # the prompt's KV goes into the cache
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for _ in range(repeats):
        for arm, extra in ARMS.items():
            params = {"max_new_tokens": tokens, "temperature": 0, **extra}
            start = time.perf_counter()
            outs = engine.generate([prompt] * batch_size, params)
            elapsed = time.perf_counter() - start
            assert all(o["meta_info"]["completion_tokens"] == tokens for o in outs), arm
            times[arm].append(1e3 * elapsed / tokens)
    return {arm: statistics.median(v) for arm, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default="demo-vl")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    from tessera.entrypoints.engine import Engine

    with Engine(args.model_path, show_progress=False) as engine:
        print("| batch | free ms/step | regex ms/step (overhead) | json_schema ms/step (overhead) |")
        print("|---:|---:|---:|---:|")
        for b in args.batch_sizes:
            r = measure(engine, b, args.tokens, args.repeats)
            free = r["free"]
            print(f"| {b} | {free:.2f} | {r['regex']:.2f} ({r['regex'] - free:+.2f}) | "
                  f"{r['json_schema']:.2f} ({r['json_schema'] - free:+.2f}) |")


if __name__ == "__main__":
    main()
