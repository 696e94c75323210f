"""A decode step of 16 requests with 4 different LoRA adapters (4 requests each) vs the base model's step, side
by side in one process (the issue's target: at most 1.3x; SGLang's csgmv backend is the reference point).

    python -m tessera.bench.lora [--model-path demo-vl] [--batch 16] [--adapters 4] [--rank 8] [--rounds 5]

The model step alone (no scheduler or sampler): `--batch` requests decode one token each over a 128-token
context; the adapters (random, rank `--rank`, on every linear layer of the language model: q/k/v/o and
gate/up/down) sit in their slots, the rows grouped by adapter as the worker groups them. Base and LoRA steps
take turns within every round, so the machine's drift falls on both alike. Also timed: the same batch with
every row on one adapter. On a shared machine `--threads 1 --cpu-time` measures the work instead of the wait.
On CUDA (`--device cuda`, the GPU check's `lora_7b` section) each case replays decode CUDA graphs as the
server does: the base step from graphs without LoRA (a server without --enable-lora), the adapter steps from
graphs that hold every slot's products (worker/cuda_graph.py).
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

from tessera.bench.metrics import median_ms
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
    def __init__(self, model_path: str, batch: int, adapters: int, rank: int, device: str = "cpu",
                 dtype: str = "float32"):
        from tessera.cache.kv_pool import ReqToTokenPool, TokenToKVPool
        from tessera.layers.lora.manager import LoraManager
        from tessera.models.registry import load_model
        from tessera.platform.device import resolve_dtype

        self.device = torch.device(device)
        self.model, config = load_model(model_path, dtype=dtype, language_model_only=True, device=self.device,
                                        attention_backend="torch_native" if self.device.type == "cpu" else "triton")
        kv = self.model.kv_layout
        self.batch, self.vocab, self.mrope = batch, config.vocab_size, config.positions == "mrope"
        width = CONTEXT + 256
        kv_dtype = resolve_dtype(dtype, config.dtype, self.device)
        self.pool = TokenToKVPool(batch * width + 1, kv.num_layers, kv.num_kv_heads, kv.head_dim, kv_dtype,
                                  self.device)
        self.req = ReqToTokenPool(batch + 1, width, self.device)  # the last row: CUDA graphs' padding (slot 0)
        gen = torch.Generator().manual_seed(0)
        self.req.req_to_token[:batch] = (1 + torch.randperm(batch * width, generator=gen)).view(batch, width)
        for layer in range(kv.num_layers):
            self.pool.k_buffers[layer].copy_(torch.randn(self.pool.k_buffers[layer].shape, generator=gen))
            self.pool.v_buffers[layer].copy_(torch.randn(self.pool.v_buffers[layer].shape, generator=gen))
        self.lora = LoraManager(self.model, type(self.model).weight_mapping(config, True), adapters, None,
                                kv_dtype, self.device)
        self._tmp = tempfile.TemporaryDirectory()
        for a in range(adapters):
            self.lora.add(f"a{a}", write_random_adapter(self.model, Path(self._tmp.name) / f"a{a}", rank, seed=a))
            self.lora.place(a, f"a{a}")
        self.adapters = adapters
        self.len = CONTEXT
        self.runners = self._graphs(rank) if self.device.type == "cuda" else None

    def _graphs(self, rank: int) -> dict:
        """Decode graphs of this batch size: without LoRA (the base server's) and with every slot's products."""
        from tessera.worker.cuda_graph import DecodeGraphRunner

        self.lora.fix_stacks(rank)
        runners = {}
        for with_lora in (False, True):
            runner = DecodeGraphRunner(self.model, self.pool, self.req.req_to_token, [self.batch], self.batch,
                                       self.mrope, lora=self.lora if with_lora else None)
            runner.capture()
            runners[with_lora] = runner
        return runners

    def step(self, slots: list[int] | None) -> None:
        b, start = self.batch, self.len
        t = lambda x: torch.as_tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
        positions = t([start] * b)
        ids, loc = t(torch.randint(0, self.vocab, (b,))), self.req.req_to_token[:b, start].clone()
        if self.runners is not None:
            from tessera.worker.cuda_graph import DecodeInputs

            self.runners[slots is not None].forward(DecodeInputs(
                ids, positions.expand(3, b) if self.mrope else positions, loc, t(range(b)), t([start + 1] * b),
                [start + 1] * b, None if slots is None else t(slots)), b)
            torch.cuda.synchronize(self.device)
        else:
            fb = ForwardBatch(
                input_ids=ids, positions=positions.expand(3, b) if self.mrope else positions, out_cache_loc=loc,
                req_pool_indices=t(range(b)), seq_lens=t([start + 1] * b), extend_lens=t([1] * b),
                req_to_token=self.req.req_to_token, logits_indices=t(range(b)), host_seq_lens=[start + 1] * b,
                host_extend_lens=[1] * b, host_req_pool_indices=list(range(b)), lora_rows=slots is not None)
            with self.lora.rows(slots, [1] * b):
                self.model(fb, self.pool)
        self.len = CONTEXT + (self.len - CONTEXT + 1) % 200


@torch.inference_mode()
def run(model_path: str, batch: int, adapters: int, rank: int, rounds: int, threads: int, steps: int = 20,
        cpu_time: bool = False, device: str = "cpu", dtype: str = "float32") -> dict:
    from tessera.bench.medium import resolve_bench_model

    torch.set_num_threads(threads)
    # The context's K/V: random values in the pool (lengths matter to a decode step's cost, values do not).
    bench = _Bench(resolve_bench_model(model_path), batch, adapters, rank, device, dtype)
    mixed = [i % adapters for i in range(batch)]  # interleaved, as arrivals mix them: one group per adapter
    cases = {"base": None, "one_adapter": [0] * batch, f"{adapters}_adapters": mixed}
    out: dict = {name: [] for name in cases}
    for _ in range(rounds):
        for name, slots in cases.items():
            out[name].append(median_ms(lambda s=slots: bench.step(s), steps,
                                        time.process_time if cpu_time else time.perf_counter))
    summary = {name: statistics.median(v) for name, v in out.items()}
    return {"model": model_path, "batch": batch, "adapters": adapters, "rank": rank, "threads": threads,
            "device": device, "dtype": dtype, "cuda_graphs": bench.runners is not None,
            "clock": "process CPU time" if cpu_time else "wall",
            "step_ms": summary, "rounds_ms": out,
            "ratio_vs_base": {k: round(v / summary["base"], 3) for k, v in summary.items()}}


def gpu_section(path, plan) -> dict:
    """The GPU check's `lora_7b`: 16 decode rows over 4 rank-8 adapters against the base step, on the check's
    model, device and dtype (graphs on CUDA), for issue 50's target (at most 1.3x)."""
    return run(str(path), 16, 4, 8, rounds=1 if plan.tiny else 5, threads=torch.get_num_threads(),
               steps=3 if plan.tiny else 20, device=plan.device, dtype=plan.speed_dtype)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tessera.bench.lora", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="demo-vl")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by the process's CPU time (with --threads 1: insensitive to waiting for a busy core)")
    ns = ap.parse_args(argv)
    result = run(ns.model_path, ns.batch, ns.adapters, ns.rank, ns.rounds, ns.threads, cpu_time=ns.cpu_time,
                 device=ns.device, dtype=ns.dtype)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
