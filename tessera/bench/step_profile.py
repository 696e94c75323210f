"""Where one decode step's time goes: Tessera's model over the paged KV pool vs HF's with its DynamicCache.

    tessera bench profile --model-path demo-vl --batch-size 32 --context-len 256

Both sides decode `--steps` tokens for a batch of `--batch-size` text requests that already hold
`--context-len` tokens of KV (HF: one prefill builds its cache; Tessera: every request's slots are scattered
over the pool, as they are after a server has run for a while). Reported: median step time of each, and
torch.profiler's operators by self CPU time for Tessera's steps, grouped into what they are (matmul, K/V
gather, attention, elementwise, ...), taken with the layers run one kernel call at a time (the timed steps
use the decode stack's one C call where it applies). Also the prefill of those contexts (the whole batch in one
forward, median of `--prefill-runs`; HF's is the forward that builds its cache). The scheduler, the sampler and the
frontend are not in this measurement: it is the model step alone, the part that decides throughput once batches
are large.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from tessera.layers.forward_batch import ForwardBatch
from tessera.platform.launch import environment

# aten op -> group, first match wins (substring).
_GROUPS = (
    # oneDNN's few-row products and our C kernel's (a record_function range, see platform/cpu_kernels.call) too
    ("matmul", ("addmm", "aten::mm", "aten::bmm", "aten::matmul", "aten::linear", "_linear_pointwise",
                "tessera::tessera_gemv_f32")),
    ("K/V gather (index)", ("aten::index", "index_select", "aten::take")),
    ("K/V write (index_put)", ("index_put",)),
    ("attention", ("scaled_dot_product", "_flash_attention", "_efficient_attention", "baddbmm", "softmax",
                   "tessera::tessera_decode_attention_f32")),
    ("copies / layout", ("aten::copy_", "aten::contiguous", "aten::clone", "aten::cat", "aten::to", "_to_copy",
                         "aten::empty", "aten::reshape", "aten::view", "aten::transpose", "aten::expand",
                         "aten::slice", "aten::select", "aten::stack", "aten::narrow", "aten::unsqueeze",
                         "aten::as_strided", "aten::split", "aten::t")),
)


def op_group(name: str) -> str:
    for group, keys in _GROUPS:
        if any(k in name for k in keys):
            return group
    return "elementwise / other"


@dataclass(frozen=True)
class ProfileConfig:
    model_path: str = "demo-vl"
    batch_size: int = 32
    context_len: int = 256
    steps: int = 16
    warmup: int = 3
    seed: int = 0
    top: int = 15
    no_mirror: bool = False  # gather K/V from the pool every step (--disable-decode-kv-mirror)
    prefill_runs: int = 3


def _tessera_steps(cfg: ProfileConfig, model_dir: str):
    """(a function prefilling the whole batch's contexts in one forward, one running a decode step of our model
    for the whole batch)."""
    from tessera.cache.kv_pool import ReqToTokenPool, TokenToKVPool
    from tessera.models.registry import load_model

    model, config = load_model(model_dir, language_model_only=True)
    kv = config.kv_layout
    b, ctx = cfg.batch_size, cfg.context_len
    total = ctx + cfg.warmup + 2 * cfg.steps + 1  # timed steps, then as many profiled ones
    # Twice the batch's tokens, as a serving pool has room to spare (and the decode mirror may use as much).
    pool = TokenToKVPool(2 * b * total, kv.num_layers, kv.num_kv_heads, kv.head_dim)
    gen = torch.Generator().manual_seed(cfg.seed)
    for layer in range(kv.num_layers):  # any values: attention cost does not depend on them
        pool.k_buffers[layer].normal_(generator=gen)
        pool.v_buffers[layer].normal_(generator=gen)
    req = ReqToTokenPool(b, total)
    req.req_to_token[:] = (1 + torch.randperm(2 * b * total - 1, generator=gen))[: b * total].view(b, total)  # scattered
    state = {"len": ctx}
    rows = torch.arange(b)

    def step() -> None:
        n = state["len"]
        pos = torch.full((b,), n, dtype=torch.int64)
        fb = ForwardBatch(
            input_ids=torch.randint(0, config.vocab_size, (b,), generator=gen),
            positions=pos,  # [T]: text positions, for plain RoPE and M-RoPE alike
            out_cache_loc=req.req_to_token[:, n].clone(),
            req_pool_indices=rows, seq_lens=torch.full((b,), n + 1, dtype=torch.int64),
            extend_lens=torch.ones(b, dtype=torch.int64), req_to_token=req.req_to_token,
            logits_indices=rows,
            req_generations=None if cfg.no_mirror else [1] * b,  # as the engine's steps: decode K/V mirror on
        )
        model(fb, pool)
        state["len"] = n + 1

    def prefill() -> None:  # into each request's first context_len slots, as its first step would
        fb = ForwardBatch(
            input_ids=torch.randint(0, config.vocab_size, (b * ctx,), generator=gen),
            positions=torch.arange(ctx).repeat(b), out_cache_loc=req.req_to_token[:, :ctx].reshape(-1).clone(),
            req_pool_indices=rows, seq_lens=torch.full((b,), ctx, dtype=torch.int64),
            extend_lens=torch.full((b,), ctx, dtype=torch.int64), req_to_token=req.req_to_token,
            logits_indices=rows * ctx + ctx - 1)
        model(fb, pool)

    return prefill, step


def _hf_steps(cfg: ProfileConfig, model_dir: str):
    """(HF's prefill times in ms, a function running one decode step of HF's model for the whole batch)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForMultimodalLM

    hf_config = AutoConfig.from_pretrained(model_dir)
    arch = (hf_config.architectures or [""])[0]
    auto = (AutoModelForImageTextToText if hasattr(hf_config, "vision_config") else
            AutoModelForMultimodalLM if "Audio" in arch else AutoModelForCausalLM)
    model = auto.from_pretrained(model_dir).eval()
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator().manual_seed(cfg.seed)
    ids = torch.randint(0, vocab, (cfg.batch_size, cfg.context_len), generator=gen)
    prefill_ms = []
    for _ in range(cfg.prefill_runs):
        t0 = time.perf_counter()
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        prefill_ms.append((time.perf_counter() - t0) * 1e3)
    state = {"past": out.past_key_values, "len": cfg.context_len}

    def step() -> None:
        n = state["len"]
        nxt = torch.randint(0, vocab, (cfg.batch_size, 1), generator=gen)
        mask = torch.ones(cfg.batch_size, n + 1, dtype=torch.int64)
        o = model(input_ids=nxt, past_key_values=state["past"], attention_mask=mask, use_cache=True,
                  cache_position=torch.tensor([n]), logits_to_keep=1)
        state["past"], state["len"] = o.past_key_values, n + 1

    return prefill_ms, step


def _time(step, warmup: int, steps: int) -> list[float]:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times


@torch.inference_mode()
def run_profile(cfg: ProfileConfig) -> dict:
    from tessera.bench.medium import resolve_bench_model

    model_dir = resolve_bench_model(cfg.model_path)
    prefill, ours = _tessera_steps(cfg, model_dir)
    prefill_ms = [t * 1e3 for t in _time(prefill, 1, cfg.prefill_runs)]
    ours_ms = [t * 1e3 for t in _time(ours, cfg.warmup, cfg.steps)]
    # The breakdown runs the layers one kernel call at a time: the decode stack (layers/decode_stack.py) is one
    # C call over the same kernels, which the profiler would see as a single operator.
    with environment({"TESSERA_DECODE_STACK": "0"}):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(cfg.steps):
                ours()
    # torch's operators, oneDNN's (few-row products) and our C kernels' named ranges (platform/cpu_kernels.call)
    events = [e for e in prof.key_averages() if e.key.startswith(("aten::", "mkldnn::", "tessera::"))]
    total_us = sum(e.self_cpu_time_total for e in events) or 1.0
    groups: dict[str, float] = {}
    for e in events:
        groups[op_group(e.key)] = groups.get(op_group(e.key), 0.0) + e.self_cpu_time_total
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[: cfg.top]
    hf_prefill_ms, hf = _hf_steps(cfg, model_dir)
    hf_ms = [t * 1e3 for t in _time(hf, cfg.warmup, cfg.steps)]
    return {
        "config": cfg.__dict__, "torch_threads": torch.get_num_threads(),
        "tessera_step_ms_median": round(statistics.median(ours_ms), 3),
        "hf_step_ms_median": round(statistics.median(hf_ms), 3),
        "tessera_prefill_ms_median": round(statistics.median(prefill_ms), 3),
        "hf_prefill_ms_median": round(statistics.median(hf_prefill_ms), 3),
        "tessera_groups_pct": {k: round(100 * v / total_us, 1) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])},
        "tessera_top_ops": [{"op": e.key, "self_ms_per_step": round(e.self_cpu_time_total / 1e3 / cfg.steps, 3),
                             "calls_per_step": e.count // cfg.steps} for e in top],
    }


def format_profile(r: dict) -> str:
    c = r["config"]
    lines = [f"{c['model_path']}: batch {c['batch_size']}, context {c['context_len']}, {r['torch_threads']} threads",
             f"  decode step, median of {c['steps']}: tessera {r['tessera_step_ms_median']:.2f} ms, "
             f"hf {r['hf_step_ms_median']:.2f} ms "
             f"({r['tessera_step_ms_median'] / r['hf_step_ms_median']:.2f}x)",
             f"  prefill of the batch's contexts, median of {c['prefill_runs']}: tessera "
             f"{r['tessera_prefill_ms_median']:.1f} ms, hf {r['hf_prefill_ms_median']:.1f} ms "
             f"({r['tessera_prefill_ms_median'] / r['hf_prefill_ms_median']:.2f}x)",
             "  tessera step, self CPU time by kind of operator:"]
    lines += [f"    {pct:5.1f}%  {name}" for name, pct in r["tessera_groups_pct"].items()]
    lines.append("  top operators (ms per step, calls per step):")
    lines += [f"    {o['self_ms_per_step']:8.3f}  {o['calls_per_step']:4d}  {o['op']}" for o in r["tessera_top_ops"]]
    return "\n".join(lines)
