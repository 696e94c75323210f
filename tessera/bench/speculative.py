"""`tessera bench spec`: output tokens per second with and without speculative decoding, side by side.

Two engines over the same checkpoint run in this process, one plain and one with --speculative-algorithm; the
timed runs alternate between them (so a noisy machine slows both alike) and each figure is the median. At
concurrency 1 the prompts go one at a time (batch-1 latency, where speculation pays); at higher concurrency they
go in waves of that many. The outputs of the two engines are compared token by token (greedy): speculation must
not change them. Each run also times the plain engine on the same prompts with one output token: speculation
cannot shorten a request's first token (prefill, media, the round trip), so besides output tok/s the summary
gives the speedup of the time after it ("after 1st") and the first token's share of a plain run.

Datasets: `random` (random token prompts; the checkpoint's own greedy continuations, ignore_eos), `scenes`
(demo-vl's scene questions with their images, answers as the model ends them) and `copy` (demo-vl's copy task,
demo/copy_task.py: text the prompt asks back, where prompt lookup finds what comes next). ORACLE, benchmarks
only, proposes the plain engine's recorded answers: the verify step's ceiling whatever a proposer guesses, on
any dataset.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field

DATASETS = ("random", "scenes", "copy")


@dataclass
class SpecBenchConfig:
    model_path: str = "bench-medium"
    algorithm: str = "ORACLE"
    draft_model_path: str | None = None
    num_steps: int = 4
    dataset: str = "random"
    num_prompts: int = 4
    input_len: int = 64
    output_len: int = 64
    concurrency: tuple[int, ...] = (1, 16)
    num_runs: int = 3
    seed: int = 0
    engine_args: dict = field(default_factory=dict)


def _prompts(cfg: SpecBenchConfig, vocab: int, processor) -> list[dict]:
    """Per request: the Engine.generate keyword arguments of one prompt."""
    rng = random.Random(cfg.seed)
    if cfg.dataset == "random":
        return [{"input_ids": [rng.randrange(20, vocab) for _ in range(cfg.input_len)]} for _ in range(cfg.num_prompts)]
    from tessera.demo import copy_task, scenes

    out = []
    for _ in range(cfg.num_prompts):
        if cfg.dataset == "scenes":
            sample = scenes.image_sample(rng, "describe")
            text, images = sample.question, [sample.frames[0]]
        else:
            text, images = copy_task.copy_prompt(copy_task.copy_text(rng)), None
        content = [{"type": "image"}] * (1 if images else 0) + [{"type": "text", "text": text}]
        prompt = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                               tokenize=False)
        out.append({"prompt": prompt, "image_data": images})
    return out


def _timed(engine, prompts: list[dict], sp: dict, concurrency: int) -> tuple[float, list[list[int]]]:
    """(seconds, outputs) of the prompts in waves of `concurrency`."""
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        wave = prompts[i:i + concurrency]
        key = "input_ids" if "input_ids" in wave[0] else "prompt"
        outs = engine.generate(**{key: [p[key] for p in wave]}, sampling_params=sp,
                               image_data=[p.get("image_data") for p in wave] if key == "prompt" else None)
        outputs += [o["output_ids"] for o in outs]
    return time.perf_counter() - start, outputs


def _prompt_ids(engine, prompts: list[dict]) -> list[list[int]]:
    """The ids the scheduler sees for each prompt (media placeholders expanded), which ORACLE keys its answers
    on: the prompt's own logprobs carry them."""
    if "input_ids" in prompts[0]:
        return [p["input_ids"] for p in prompts]
    outs = engine.generate(prompt=[p["prompt"] for p in prompts], image_data=[p.get("image_data") for p in prompts],
                           sampling_params={"max_new_tokens": 1}, return_logprob=True, logprob_start_len=0)
    return [[token for _, token in o["meta_info"]["input_token_logprobs"]] for o in outs]


def run_spec_bench(cfg: SpecBenchConfig) -> dict:
    from transformers import AutoProcessor

    from tessera.entrypoints.engine import Engine
    from tessera.bench.medium import resolve_bench_model
    from tessera.models.config import ModelConfig

    if cfg.dataset not in DATASETS:
        raise ValueError(f"dataset: expected one of {', '.join(DATASETS)}, got {cfg.dataset!r}")
    path = resolve_bench_model(cfg.model_path, cfg.seed)
    vocab = ModelConfig.load(path).vocab_size
    processor = AutoProcessor.from_pretrained(path) if cfg.dataset != "random" else None
    prompts = _prompts(cfg, vocab, processor)
    sp = {"temperature": 0, "max_new_tokens": cfg.output_len, "ignore_eos": cfg.dataset == "random"}
    # Both engines hold every request of a wave: speculation's own batch cut-off is the engine's default.
    common = {"show_progress": False, "max_running_requests": max(max(cfg.concurrency), 16), **cfg.engine_args}
    result: dict = {"config": asdict(cfg), "model_path": path, "by_concurrency": {}}
    with Engine(path, **common) as plain:
        _timed(plain, prompts[:1], {**sp, "max_new_tokens": 4}, 1)  # warm-up
        _, reference = _timed(plain, prompts, sp, 1)
        spec_args = {"speculative_algorithm": cfg.algorithm, "speculative_num_steps": cfg.num_steps}
        if cfg.algorithm == "ORACLE":
            f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
            ids = _prompt_ids(plain, prompts)
            with f:
                json.dump([{"input_ids": i, "output_ids": o} for i, o in zip(ids, reference)], f)
            spec_args["speculative_oracle_path"] = f.name
        if cfg.draft_model_path:
            spec_args["speculative_draft_model_path"] = cfg.draft_model_path
        with Engine(path, **common, **spec_args) as spec:
            _timed(spec, prompts[:1], {**sp, "max_new_tokens": 4}, 1)
            for c in cfg.concurrency:
                before = spec.get_server_info()["stats"]
                runs: dict[str, list[float]] = {"plain": [], "spec": [], "first_token_s": []}
                identical = True
                for _ in range(cfg.num_runs):
                    for name, engine in (("plain", plain), ("spec", spec)):
                        seconds, outs = _timed(engine, prompts, sp, c)
                        runs[name].append(sum(map(len, outs)) / seconds)
                        identical &= outs == reference
                    runs["first_token_s"].append(_timed(plain, prompts, {**sp, "max_new_tokens": 1}, c)[0])
                after = spec.get_server_info()["stats"]
                verifies = after["spec_verifies"] - before["spec_verifies"]
                accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
                drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
                plain_rate, spec_rate = statistics.median(runs["plain"]), statistics.median(runs["spec"])
                # What speculation can change is the time after each request's first token (a streaming
                # user's time per output token): the run's time less the same prompts' one-token run.
                tokens, first = sum(map(len, reference)), statistics.median(runs["first_token_s"])
                after_plain, after_spec = tokens / plain_rate - first, tokens / spec_rate - first
                result["by_concurrency"][str(c)] = {
                    "plain_tok_s": round(plain_rate, 2), "spec_tok_s": round(spec_rate, 2),
                    "speedup": round(spec_rate / plain_rate, 3), "runs": runs, "identical": identical,
                    "first_token_share": round(first / (tokens / plain_rate), 3),
                    "after_first_speedup": round(after_plain / after_spec, 3) if after_spec > 0 else None,
                    "accept_length": round(1 + accepted / verifies, 3) if verifies else None,
                    "accept_rate": round(accepted / drafted, 3) if drafted else None, "verify_steps": verifies}
    return result


def format_summary(result: dict) -> str:
    cfg = result["config"]
    lines = [f"speculative decoding: {cfg['algorithm']} k={cfg['num_steps']} on {result['model_path']} "
             f"({cfg['dataset']}, {cfg['num_prompts']} prompts, {cfg['output_len']} tokens, median of "
             f"{cfg['num_runs']})",
             f"{'concurrency':>11} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8} {'after 1st':>9} "
             f"{'1st share':>9} {'accept len':>10} {'rate':>6} identical"]
    for c, r in result["by_concurrency"].items():
        length = "-" if r["accept_length"] is None else f"{r['accept_length']:.2f}"
        rate = "-" if r["accept_rate"] is None else f"{r['accept_rate']:.2f}"
        after = "-" if r["after_first_speedup"] is None else f"{r['after_first_speedup']:.2f}x"
        lines.append(f"{c:>11} {r['plain_tok_s']:>12.1f} {r['spec_tok_s']:>11.1f} {r['speedup']:>7.2f}x {after:>9} "
                     f"{r['first_token_share']:>9.2f} {length:>10} {rate:>6} {r['identical']}")
    return "\n".join(lines)
