"""Decode step of a Qwen3.5-shaped hybrid model vs a dense Qwen3 of about the same size, on this machine's CPU.

`python -m tessera.bench.hybrid_decode [--batch 8] [--context 1024] [--steps 15]`: random float32 weights, the
torch_native attention backend, B requests each prefilled to `context` tokens, then the median of `steps` decode
steps (one token per request, as the worker runs them, without its scheduler). The hybrid model is Qwen3-Next's
text stack with dense MLPs (Qwen3.5's layers: 3 Gated DeltaNet layers to 1 gated full-attention layer); the
dense one is Qwen3 with the same width, depth and attention heads (MLPs a little wider: equal parameters).
`--next-turn N`: the hybrid's prefill of a chat's next turn (N tokens after `context`), whole and from the prefix
cache's state snapshot.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tessera.cache.kv_pool import ReqToTokenPool, TokenToKVPool
from tessera.cache.state_pool import StatePool
from tessera.layers.attention import get_attention_backend
from tessera.layers.forward_batch import ForwardBatch
from tessera.models.config import ModelConfig

WIDTH, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 1024, 16, 8, 2, 128, 3072
DENSE_FFN = 3540  # the dense model's MLPs a little wider: both have ~282M parameters


def configs() -> dict[str, object]:
    from transformers import Qwen3Config, Qwen3NextConfig

    common = dict(vocab_size=32000, hidden_size=WIDTH, intermediate_size=FFN, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                  max_position_embeddings=65536)
    hybrid = Qwen3NextConfig(**common, num_experts=0, linear_num_key_heads=4, linear_num_value_heads=8,
                             linear_key_head_dim=128, linear_value_head_dim=128, architectures=["Qwen3NextForCausalLM"])
    dense = Qwen3Config(**{**common, "intermediate_size": DENSE_FFN}, architectures=["Qwen3ForCausalLM"])
    return {"hybrid (Qwen3.5-shaped)": hybrid, "dense Qwen3": dense}


def _batch(table: ReqToTokenPool, rows: list[int], starts: list[int], lens: list[int],
           ids: torch.Tensor) -> ForwardBatch:
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    locs = torch.cat([table.req_to_token[r, s:s + n] for r, s, n in zip(rows, starts, lens)])
    seq = [s + n for s, n in zip(starts, lens)]
    return ForwardBatch(input_ids=ids, positions=positions, out_cache_loc=locs, req_pool_indices=torch.tensor(rows),
                        seq_lens=torch.tensor(seq), extend_lens=torch.tensor(lens), req_to_token=table.req_to_token,
                        host_seq_lens=seq, host_extend_lens=lens, host_req_pool_indices=rows)


def _build(hf_config, rows: int, total: int, slots: int = 0):
    """(model with random weights, its KV pool (and state pool with `slots` snapshot slots), a table whose row r
    holds slots 1 + r * total ...)."""
    config = ModelConfig.from_hf(hf_config)
    model = config.family.model_class().build(config, get_attention_backend("torch_native"))
    torch.manual_seed(0)
    for p in model.parameters():
        p.normal_(0, 0.02)
    model.eval()
    layout = model.kv_layout
    pool = TokenToKVPool(rows * total, layout.num_layers, layout.num_kv_heads, layout.head_dim)
    if model.state_layout is not None:
        pool.state = StatePool(model.state_layout, rows + slots, torch.float32, rows=rows)
    table = ReqToTokenPool(rows, total)
    table.req_to_token[:] = torch.arange(1, rows * total + 1).view(rows, total)
    return model, pool, table


def _prefill(model, pool, table, row: int, start: int, ids: torch.Tensor) -> None:
    """ids after `start` tokens of request row `row`, in 512-token forwards."""
    for lo in range(0, len(ids), 512):
        n = min(512, len(ids) - lo)
        model(_batch(table, [row], [start + lo], [n], ids[lo:lo + n]), pool)


@torch.inference_mode()
def decode_ms(hf_config, batch: int, context: int, steps: int) -> tuple[float, int]:
    """(median decode-step milliseconds, parameters)."""
    model, pool, table = _build(hf_config, batch, context + steps + 1)
    rows = list(range(batch))
    for r in rows:  # one request per prefill forward, 512-token chunks
        _prefill(model, pool, table, r, 0, torch.randint(0, 32000, (context,)))
    times = []
    for i in range(steps):
        fb = _batch(table, rows, [context + i] * batch, [1] * batch, torch.randint(0, 32000, (batch,)))
        t = time.perf_counter()
        model(fb, pool)
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times), sum(p.numel() for p in model.parameters())


@torch.inference_mode()
def next_turn_ms(hf_config, history: int, turn: int) -> tuple[float, float]:
    """A chat's next turn (`turn` new tokens after `history` tokens): (ms to prefill it all, ms from the prefix
    cache: the history's K/V shared and its state snapshot copied into the request's row, as the engine does)."""
    model, pool, table = _build(hf_config, 3, history + turn, slots=1)
    ids = torch.randint(0, 32000, (history + turn,))
    _prefill(model, pool, table, 0, 0, ids[:history])  # the first turn; its state becomes the snapshot
    pool.state.copy([(0, 3)])
    t = time.perf_counter()
    _prefill(model, pool, table, 1, 0, ids)
    full = time.perf_counter() - t
    t = time.perf_counter()
    table.req_to_token[2, :history] = table.req_to_token[0, :history]
    pool.state.copy([(3, 2)])
    _prefill(model, pool, table, 2, history, ids[history:])
    return full * 1000, (time.perf_counter() - t) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--next-turn", type=int, default=0, metavar="N",
                        help="instead: a next turn of N tokens after --context tokens of history, prefilled whole "
                             "and from the prefix cache (the hybrid model)")
    args = parser.parse_args()
    if args.next_turn:
        full, cached = next_turn_ms(configs()["hybrid (Qwen3.5-shaped)"], args.context, args.next_turn)
        print(f"hybrid next turn of {args.next_turn} tokens after {args.context}: prefilled whole {full:.0f} ms, "
              f"from the state snapshot {cached:.0f} ms")
        return
    for name, cfg in configs().items():
        ms, params = decode_ms(cfg, args.batch, args.context, args.steps)
        print(f"{name}: {params / 1e6:.0f}M parameters, batch {args.batch} at {args.context} tokens: "
              f"decode step median {ms:.1f} ms")


if __name__ == "__main__":
    main()
