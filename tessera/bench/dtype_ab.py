"""Batch-1 decode and a 256-token prefill of one model in several weight dtypes, in one process, alternating.

    python -m tessera.bench.dtype_ab [--model-path bench-medium] [--dtypes float32,bfloat16,float16]
                                     [--rounds 3] [--threads 2]

Each dtype's checkpoint is bench-medium written in it (`python -m tessera.bench.medium --dtype ...`), or the
same checkpoint loaded with `--dtype` for a model path. The model step alone (no scheduler, sampler or frontend):
a decode step over a 256-token context whose KV slots are scattered over the pool, and a prefill of 256 new
tokens; the dtypes take turns within every round, so the machine's drift falls on all of them alike.
On a shared machine `--threads 1 --cpu-time` measures the work instead of the wait for a core. Also
printed: the bytes of weights a decode step reads, the machine's read and copy bandwidth (256 MB) measured
between rounds, and the read floor (those bytes over the read bandwidth).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from tessera.bench.metrics import median_ms

from tessera.layers.forward_batch import ForwardBatch

CONTEXT = PREFILL = 256


def _bandwidth() -> tuple[float, float]:
    """(read, copy) GB/s over 256 MB, best of 5: src.sum() reads it, dst.copy_(src) reads and writes it."""
    src, dst = torch.ones(1 << 26), torch.empty(1 << 26)
    reads, copies = [], []
    for _ in range(5):
        t = time.perf_counter()
        src.sum()
        reads.append(src.nbytes / (time.perf_counter() - t) / 1e9)
        t = time.perf_counter()
        dst.copy_(src)
        copies.append(2 * src.nbytes / (time.perf_counter() - t) / 1e9)
    return max(reads), max(copies)


def _weight_bytes(model) -> int:
    """What one decode step reads: every 2-D parameter of the language model but the input embedding table
    (its one row per token), once; a tied LM head is that table and counts here."""
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if p.dim() == 2 and id(p) not in seen and "visual" not in name and "vision" not in name:
            seen.add(id(p))
            total += p.nbytes
    return total - model.model.embed_tokens.weight.nbytes * (model.lm_head.weight is not model.model.embed_tokens.weight)


class _Variant:
    """One dtype's model, pool and slot table; decode() and prefill() run one step each."""

    def __init__(self, model_dir: str, dtype: str, seed: int = 0):
        from tessera.cache.kv_pool import ReqToTokenPool, TokenToKVPool
        from tessera.models.registry import load_model
        from tessera.platform.device import compute_dtype, resolve_dtype

        self.model, config = load_model(model_dir, dtype=dtype, language_model_only=True)
        run = compute_dtype(resolve_dtype(dtype, config.dtype))
        kv = config.kv_layout
        self.vocab = config.vocab_size
        self.slots = 1 << 14
        self.pool = TokenToKVPool(self.slots + 1, kv.num_layers, kv.num_kv_heads, kv.head_dim, dtype=run)
        self.gen = torch.Generator().manual_seed(seed)
        for layer in range(kv.num_layers):  # any values: the cost does not depend on them
            self.pool.k_buffers[layer].normal_(generator=self.gen)
            self.pool.v_buffers[layer].normal_(generator=self.gen)
        self.req = ReqToTokenPool(2, self.slots // 2)
        self.req.req_to_token[:] = (1 + torch.randperm(self.slots, generator=self.gen)).view(2, -1)  # scattered
        self.len = CONTEXT
        self.weight_bytes = _weight_bytes(self.model)

    def _step(self, row: int, start: int, n: int, logits_row: int) -> None:
        self.model(ForwardBatch(
            input_ids=torch.randint(0, self.vocab, (n,), generator=self.gen),
            positions=torch.arange(start, start + n), out_cache_loc=self.req.req_to_token[row, start:start + n].clone(),
            req_pool_indices=torch.tensor([row]), seq_lens=torch.tensor([start + n]),
            extend_lens=torch.tensor([n]), req_to_token=self.req.req_to_token,
            logits_indices=torch.tensor([logits_row]), req_generations=[1] if n == 1 else None), self.pool)

    def decode(self) -> None:
        if self.len >= self.slots // 2 - 1:
            self.len = CONTEXT
        self._step(0, self.len, 1, 0)
        self.len += 1

    def prefill(self) -> None:
        self._step(1, 0, PREFILL, PREFILL - 1)


@torch.inference_mode()
def run(model_path: str, dtypes: list[str], rounds: int, threads: int, decode_steps: int = 32,
        cpu_time: bool = False) -> dict:
    from tessera.bench.medium import MEDIUM_NAME, build_medium, resolve_bench_model

    torch.set_num_threads(threads)
    clock = time.process_time if cpu_time else time.perf_counter
    dirs = {d: str(build_medium(dtype=d)) if model_path == MEDIUM_NAME else resolve_bench_model(model_path)
            for d in dtypes}
    variants = {d: _Variant(dirs[d], "auto" if model_path == MEDIUM_NAME else d) for d in dtypes}
    for v in variants.values():
        v._step(0, 0, CONTEXT, CONTEXT - 1)  # the decode context's KV (values do not matter, lengths do)
    out: dict = {d: {"decode_ms": [], "prefill_tok_s": [], "weight_bytes": v.weight_bytes} for d, v in variants.items()}
    out["bandwidth_gb_s"] = []
    for _ in range(rounds):
        out["bandwidth_gb_s"].append(_bandwidth())
        for d, v in variants.items():
            out[d]["decode_ms"].append(median_ms(v.decode, decode_steps, clock))
            out[d]["prefill_tok_s"].append(PREFILL / median_ms(v.prefill, 3, clock) * 1e3)
    read = statistics.median(r for r, _ in out["bandwidth_gb_s"])
    for d in dtypes:
        row = out[d]
        row["decode_ms_median"] = statistics.median(row["decode_ms"])
        row["prefill_tok_s_median"] = statistics.median(row["prefill_tok_s"])
        row["read_floor_ms"] = row["weight_bytes"] / read / 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tessera.bench.dtype_ab", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default="bench-medium")
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-time", action="store_true",
                    help="time by the process's CPU time (with --threads 1: insensitive to waiting for a busy core)")
    ns = ap.parse_args(argv)
    result = run(ns.model_path, ns.dtypes.split(","), ns.rounds, ns.threads, cpu_time=ns.cpu_time)
    for d in ns.dtypes.split(","):
        r = result[d]
        print(f"{d:9s} decode {r['decode_ms_median']:.2f} ms/token (rounds {', '.join(f'{x:.2f}' for x in r['decode_ms'])}), "
              f"floor {r['read_floor_ms']:.2f} ms ({r['weight_bytes'] / 1e6:.1f} MB); prefill "
              f"{r['prefill_tok_s_median']:.0f} tok/s ({', '.join(f'{x:.0f}' for x in r['prefill_tok_s'])})")
    print("read / copy GB/s per round:", json.dumps([[round(a, 1), round(b, 1)] for a, b in result["bandwidth_gb_s"]]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
