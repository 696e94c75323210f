"""The GPU check's dry run (`--device cpu --tiny`): every section runs on tiny sizes and reports figures;
fp32 parity with HF holds on the CPU, the serving section completes every request."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from tessera.bench.gpu_check import Plan, run


@pytest.mark.slow  # builds three checkpoints, runs HF and Tessera side by side and a `tessera serve`: ~30 s
def test_dry_run_runs_every_section(tmp_path) -> None:
    # `--tiny`'s plan with fewer requests and prompts (its 6 decode steps stay: timings are differences): every section still runs with each of its parts.
    plan = replace(Plan.make("cpu", tiny=True, deadline_s=300), offline_requests=2, serving_prompts=4,
                   serving_concurrency=2)
    report = run(tmp_path / "out", plan, tmp_path / "work", log=lambda *_: None)
    sections = report["sections"]
    assert set(sections) == {"checkpoints", "parity_fp32", "bandwidth", "decode_2b", "decode_7b", "offline_a_7b",
                             "serving_7b"}
    assert all("result" in s for s in sections.values()), {k: s.get("error") for k, s in sections.items()}
    parity = sections["parity_fp32"]["result"]
    assert parity["all_identical"] and parity["identical_fraction"] == 1.0 and parity["max_logprob_diff"] < 1e-3
    assert [r["case"] for r in parity["cases"]][-2:] == ["text (prefix hit)", "image (prefix hit)"]
    assert parity["cases"][-1]["cached_tokens"] > 0
    for name in ("decode_2b", "decode_7b"):
        d = sections[name]["result"]
        # Per-step times are differences of two timings, (T(n) - T(1)) / (n - 1): on a loaded CPU with tiny
        # models they can come out negative, so the dry run checks that they were measured, not their sign.
        assert math.isfinite(d["tessera_b1_ms"]) and math.isfinite(d["hf_b1_ms"]) and d["floor_ms"] > 0
        assert 8 in d["tessera_step_ms"] and all(math.isfinite(v) for v in d["tessera_step_ms"].values())
    assert sections["offline_a_7b"]["result"]["a"]["tessera"]["tok_s"] > 0
    serving = sections["serving_7b"]["result"]
    assert serving["num_completed"] == plan.serving_prompts and serving["num_failed"] == 0
    saved = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert saved["sections"]["parity_fp32"]["result"]["all_identical"]
    assert "| 2b |" in (tmp_path / "out" / "gpu_check.md").read_text()


def test_a_section_that_does_not_fit_the_deadline_is_skipped(tmp_path) -> None:
    report = run(tmp_path / "out", Plan.make("cpu", tiny=False, deadline_s=0), tmp_path / "work", log=lambda *_: None)
    assert all("skipped" in s for name, s in report["sections"].items() if name != "bandwidth")
    assert "skipped" in (tmp_path / "out" / "gpu_check.md").read_text()
