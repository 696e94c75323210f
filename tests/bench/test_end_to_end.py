"""Both benchmarks against the real engine with demo-vl, a few requests and tokens each (marked slow)."""

from __future__ import annotations

import asyncio

import pytest

from tessera.bench.offline import OfflineConfig, run_offline
from tessera.bench.serving import ServingConfig, run_benchmark_async

pytestmark = pytest.mark.slow


def test_serving_benchmark_against_tessera_serve(vl_server) -> None:
    """Against the session's demo-vl server (the sweep's own LocalServer start is the same launcher)."""
    cfg = ServingConfig(base_url=vl_server.base_url, dataset="scenes", num_prompts=3, output_len=4,
                        max_concurrency=2, disable_tqdm=True)
    result = asyncio.run(run_benchmark_async(cfg))
    m = result["metrics"]
    assert result["model"] == "demo-vl"
    assert (m["num_completed"], m["num_failed"]) == (3, 0), m["errors"]
    # ignore_eos + min_tokens reach the scheduler: every request produced exactly output_len tokens.
    assert m["total_output_tokens"] == 3 * 4
    assert m["total_input_tokens"] > 3 * 16  # image tokens included, counted by the server


def test_offline_benchmark_runs_every_workload_on_both_systems() -> None:
    cfg = OfflineConfig(num_requests=2, max_output_len=2, decode_len=2, num_runs=1, num_distinct_images=1,
                        system_prompt_len=64)
    out = run_offline(cfg, log=lambda *_: None)
    r = out["results"]
    assert {"tessera", "hf", "ratio_vs_hf"} <= set(r["a"])
    # Both sides recorded workload a's greedy outputs: in float32 they are the same tokens and logprobs.
    same = r["a"]["agreement_vs_hf"]
    assert same["identical_requests"] == 1.0 and same["logprobs_compared"] == 4 and same["max_logprob_diff"] < 1e-3
    assert r["b"]["tessera"]["ttft_repeat_ms"] is not None  # 2 requests over 1 image: one repeat
    # The shared system prompt (64 tokens) and the one image of b are computed once with caches on.
    assert r["c"]["tessera"]["prefill_tokens"] < r["c"]["tessera_nocache"]["prefill_tokens"]
    assert set(r["d"]["tessera"]) == {"bs1", "bs2"}


def test_step_profile_times_both_models_and_accounts_for_every_operator() -> None:
    from tessera.bench.step_profile import ProfileConfig, format_profile, run_profile

    r = run_profile(ProfileConfig(batch_size=3, context_len=20, steps=2, warmup=1))
    assert r["tessera_step_ms_median"] > 0 and r["hf_step_ms_median"] > 0
    assert r["tessera_prefill_ms_median"] > 0 and r["hf_prefill_ms_median"] > 0
    assert sum(r["tessera_groups_pct"].values()) == pytest.approx(100, abs=0.5)
    assert {"matmul", "attention"} <= set(r["tessera_groups_pct"])
    # Float32 decode on a CPU reads the pool through our C kernel where it is built, else gathers K/V.
    from tessera.platform import cpu_kernels

    expected = "tessera_decode_attention_f32" if cpu_kernels.available("decode_attention") else "index_select"
    assert any(expected in o["op"] for o in r["tessera_top_ops"])
    assert "decode step, median of 2" in format_profile(r) and "prefill of the batch's contexts" in format_profile(r)
