"""A decode step of 16 requests with 4 different LoRA adapters (4 requests each) vs the base model's step, side
by side in one process (the issue's target: at most 1.3x; SGLang's csgmv backend is the reference point).

    python -m tessera.bench.lora [--model-path demo-vl] [--batch 16] [--adapters 4] [--rank 8] [--rounds 5]

The model step alone (no scheduler or sampler): `--batch` requests decode one token each over a 128-token
context; the adapters (random, rank `--rank`, on every linear layer of the language model: q/k/v/o and
gate/up/down) sit in their slots, the rows grouped by adapter as the worker groups them. Base and LoRA steps
take turns within every round, so the machine's drift falls on both alike. Also timed: the same batch with
every row on one adapter. On a shared machine `--threads 1 --cpu-time` measures the work instead of the wait.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from tessera.layers.forward_batch import ForwardBatch
from tessera.layers.linear import MergedLinear

CONTEXT = 128
PEFT_NAMES = {"qkv_proj": ("self_attn", ["q_proj", "k_proj", "v_proj"]), "o_proj": ("self_attn", ["o_proj"]),
              "gate_up_proj": ("mlp", ["gate_proj", "up_proj"]), "down_proj": ("mlp", ["down_proj"])}


def write_random_adapter(model, path: Path, rank: int, seed: int, scale: float = 0.05) -> Path:
    """A PEFT-format adapter (adapter_config.json + adapter_model.safetensors) of rank `rank` on every linear
    layer of `model`'s decoder (our model: shapes read from its modules, named as the HF checkpoint names
    them), with random A and B."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, layer in enumerate(model.model.layers):
        for ours, (parent, peft_names) in PEFT_NAMES.items():
            linear = getattr(getattr(layer, parent), ours)
            sizes = list(linear.output_sizes.values()) if isinstance(linear, MergedLinear) else [linear.out_features]
            for name, out in zip(peft_names, sizes):
                key = f"base_model.model.model.layers.{i}.{parent}.{name}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, linear.in_features, generator=gen) * scale
                tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * scale
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    targets = [n for _, names in PEFT_NAMES.values() for n in names]
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                          "target_modules": targets, "bias": "none"}))
    return path


class _Bench:
    def __init__(self, model_path: str, batch: int, adapters: int, rank: int):
        from tessera.cache.kv_pool import ReqToTokenPool, TokenToKVPool
        from tessera.layers.lora.manager import LoraManager
        from tessera.models.registry import load_model

        self.model, config = load_model(model_path, dtype="float32", language_model_only=True)
        kv = self.model.kv_layout
        self.batch, self.vocab, self.mrope = batch, config.vocab_size, config.positions == "mrope"
        width = CONTEXT + 256
        self.pool = TokenToKVPool(batch * width + 1, kv.num_layers, kv.num_kv_heads, kv.head_dim)
        self.req = ReqToTokenPool(batch, width)
        gen = torch.Generator().manual_seed(0)
        self.req.req_to_token[:] = (1 + torch.randperm(batch * width, generator=gen)).view(batch, width)
        for layer in range(kv.num_layers):
            self.pool.k_buffers[layer].normal_(generator=gen)
            self.pool.v_buffers[layer].normal_(generator=gen)
        self.lora = LoraManager(self.model, type(self.model).weight_mapping(config, True), adapters, None,
                                torch.float32, torch.device("cpu"))
        self._tmp = tempfile.TemporaryDirectory()
        for a in range(adapters):
            self.lora.add(f"a{a}", write_random_adapter(self.model, Path(self._tmp.name) / f"a{a}", rank, seed=a))
            self.lora.place(a, f"a{a}")
        self.adapters = adapters
        self.len = CONTEXT

    def step(self, slots: list[int] | None) -> None:
        b, start = self.batch, self.len
        positions = torch.full((b,), start)
        fb = ForwardBatch(
            input_ids=torch.randint(0, self.vocab, (b,)),
            positions=positions.expand(3, b) if self.mrope else positions,
            out_cache_loc=self.req.req_to_token[:, start].clone(), req_pool_indices=torch.arange(b),
            seq_lens=torch.full((b,), start + 1), extend_lens=torch.ones(b, dtype=torch.int64),
            req_to_token=self.req.req_to_token, logits_indices=torch.arange(b), host_seq_lens=[start + 1] * b,
            host_extend_lens=[1] * b, host_req_pool_indices=list(range(b)), lora_rows=slots is not None)
        with self.lora.rows(slots, [1] * b):
            self.model(fb, self.pool)
        self.len = CONTEXT + (self.len - CONTEXT + 1) % 200


def _median_ms(fn, n: int, clock=time.perf_counter) -> float:
    fn()
    times = []
    for _ in range(n):
        t = clock()
        fn()
        times.append(clock() - t)
    return statistics.median(times) * 1e3


@torch.inference_mode()
def run(model_path: str, batch: int, adapters: int, rank: int, rounds: int, threads: int, steps: int = 20,
        cpu_time: bool = False) -> dict:
    from tessera.bench.medium import resolve_bench_model

    torch.set_num_threads(threads)
    bench = _Bench(resolve_bench_model(model_path), batch, adapters, rank)
    # Prefill every request's context (lengths matter, values do not).
    for r in range(batch):
        bench.model(ForwardBatch(
            input_ids=torch.randint(0, bench.vocab, (CONTEXT,)), positions=torch.arange(CONTEXT).expand(3, CONTEXT)
            if bench.mrope else torch.arange(CONTEXT), out_cache_loc=bench.req.req_to_token[r, :CONTEXT].clone(),
            req_pool_indices=torch.tensor([r]), seq_lens=torch.tensor([CONTEXT]), extend_lens=torch.tensor([CONTEXT]),
            req_to_token=bench.req.req_to_token, logits_indices=torch.tensor([CONTEXT - 1])), bench.pool)
    mixed = [i % adapters for i in range(batch)]  # interleaved, as arrivals mix them: one group per adapter
    cases = {"base": None, "one_adapter": [0] * batch, f"{adapters}_adapters": mixed}
    out: dict = {name: [] for name in cases}
    for _ in range(rounds):
        for name, slots in cases.items():
            out[name].append(_median_ms(lambda s=slots: bench.step(s), steps,
                                        time.process_time if cpu_time else time.perf_counter))
    summary = {name: statistics.median(v) for name, v in out.items()}
    return {"model": model_path, "batch": batch, "adapters": adapters, "rank": rank, "threads": threads,
            "clock": "process CPU time" if cpu_time else "wall",
            "step_ms": summary, "rounds_ms": out,
            "ratio_vs_base": {k: round(v / summary["base"], 3) for k, v in summary.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tessera.bench.lora", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="demo-vl")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by the process's CPU time (with --threads 1: insensitive to waiting for a busy core)")
    ns = ap.parse_args(argv)
    result = run(ns.model_path, ns.batch, ns.adapters, ns.rank, ns.rounds, ns.threads, cpu_time=ns.cpu_time)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
