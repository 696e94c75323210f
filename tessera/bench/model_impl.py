"""Qwen2-VL served natively and on the Transformers backend (`--model-impl`), side by side, through tessera.Engine.

    python -m tessera.bench.model_impl [--model-path demo-vl|bench-medium] [--batch-size 8] [--repeats 3]

Per implementation, medians of `--repeats` runs, the two implementations interleaved within each repeat:
- decode step: `--batch-size` text requests (a 64-token prompt each) generating 1 and then 65 tokens (ignore_eos);
  a step is (T(65) - T(1)) / 64;
- serving: 16 chat requests with one image each (two sizes), 32 output tokens each, submitted at once: output
  tokens per second of wall time (prefill, encoder and decode together).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

IMPLS = ("native", "transformers")
PROMPT_TOKENS = 64
DECODE_TOKENS = 64
SERVING_REQUESTS = 16
SERVING_TOKENS = 32


def _timed(engine, prompts, images, max_new_tokens: int) -> float:
    start = time.perf_counter()
    engine.generate(prompt=prompts, image_data=images, sampling_params={
        "temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True})
    return time.perf_counter() - start


def _workloads(engine, batch_size: int):
    from tessera.demo import scenes

    ids = engine.tokenizer("a short story about the sea " * 16)["input_ids"][:PROMPT_TOKENS]
    text = [engine.tokenizer.decode(ids)] * batch_size
    rng = random.Random(0)
    pictures = [scenes.image_sample(rng).frames[0].resize(size) for size in ((224, 168), (112, 224))]
    chat = engine.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What is in the image?"}]}])
    images = [[pictures[i % 2]] for i in range(SERVING_REQUESTS)]
    return text, [chat] * SERVING_REQUESTS, images


def measure(model_path: str, batch_size: int, repeats: int) -> dict[str, dict[str, float]]:
    """{impl: {"decode_step_ms", "serving_tok_s"}} (medians)."""
    from tessera.entrypoints.engine import Engine

    engines = {impl: Engine(model_path, model_impl=impl, show_progress=False) for impl in IMPLS}
    steps: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    rates: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    try:
        text, chats, images = _workloads(engines["native"], batch_size)
        for impl in IMPLS:  # warm-up: first calls' lazy setup
            _timed(engines[impl], chats[:2], images[:2], 2)
        for _ in range(repeats):
            for impl, engine in engines.items():
                t1 = _timed(engine, text, None, 1)
                t65 = _timed(engine, text, None, DECODE_TOKENS + 1)
                steps[impl].append((t65 - t1) / DECODE_TOKENS * 1000)
                engine.flush_cache()  # the images are encoded and prefilled in every repeat
                rates[impl].append(SERVING_REQUESTS * SERVING_TOKENS / _timed(engine, chats, images, SERVING_TOKENS))
    finally:
        for engine in engines.values():
            engine.shutdown()
    return {impl: {"decode_step_ms": statistics.median(steps[impl]), "serving_tok_s": statistics.median(rates[impl])}
            for impl in IMPLS}


def main(argv: list[str] | None = None) -> int:
    from tessera.bench.medium import resolve_bench_model

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="demo-vl", help="a Qwen2-VL checkpoint, demo-vl or bench-medium")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    result = measure(resolve_bench_model(args.model_path), args.batch_size, args.repeats)
    native, backend = result["native"], result["transformers"]
    print(f"| {args.model_path} | decode step, batch {args.batch_size} | {native['decode_step_ms']:.1f} ms | "
          f"{backend['decode_step_ms']:.1f} ms | {backend['decode_step_ms'] / native['decode_step_ms']:.2f}x |")
    print(f"| {args.model_path} | serving, {SERVING_REQUESTS} image chats x {SERVING_TOKENS} tokens | "
          f"{native['serving_tok_s']:.1f} tok/s | {backend['serving_tok_s']:.1f} tok/s | "
          f"{native['serving_tok_s'] / backend['serving_tok_s']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
