"""The GPU check (`python -m tessera.bench.gpu_check`): its CPU dry run (`--device cpu --tiny`) runs every
section, writes its files after each one, keeps checkpoints out of --out, counts the decode floor over the
language model's weights only and prints each target as met / not met; the budget cuts parts inside a
section and records it; the CUDA-graph report is read defensively; the command refuses a work dir in --out."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tessera.bench import gpu_check, gpu_sections
from tessera.bench.gpu_check import run
from tessera.bench.gpu_sections import Budget, Plan, decode_weight_bytes, graph_report

ALL_SECTIONS = ["preflight", "checkpoints", "parity_fp32", "bandwidth", "decode_7b", "offline_a_7b", "serving_7b", "spec_oracle_7b",
                "lora_7b", "serving_7b_overlap"]


def _saved(out: Path) -> dict:
    return json.loads((out / "gpu_check.json").read_text())


@pytest.mark.slow  # builds two checkpoints, runs HF and Tessera side by side and a `tessera serve`: ~25 s
def test_dry_run_runs_every_section_and_writes_after_each(tmp_path, monkeypatch) -> None:
    # PyAV is not carried to the GPU machine: the run must not import it, here or in the processes it starts.
    blocker = tmp_path / "blocked" / "av"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('PyAV is blocked in this test')\n")
    monkeypatch.setenv("PYTHONPATH", f"{blocker.parent}:{':'.join(sys.path)}")
    monkeypatch.setitem(sys.modules, "av", None)
    out, work = tmp_path / "out", tmp_path / "work"
    seen: dict[str, dict] = {}  # what the files held when each section had just ended

    def log(line: str) -> None:
        name = line.removeprefix("[gpu_check] ").split(":")[0]
        if name in ALL_SECTIONS:
            seen[name] = _saved(out)["sections"]
            assert "## Targets" in (out / "gpu_check.md").read_text()

    # `--tiny`'s plan with fewer requests and prompts (its 6 decode steps stay: timings are differences).
    plan = replace(Plan.make("cpu", tiny=True, budget_s=600), offline_requests=2, serving_prompts=4,
                   serving_concurrency=2)
    report = run(out, plan, work, log=log)
    sections = report["sections"]
    assert list(sections) == ALL_SECTIONS
    assert all("result" in s and "cut" not in s for s in sections.values()), \
        {k: s.get("error") or s.get("cut") for k, s in sections.items()}
    for i, name in enumerate(ALL_SECTIONS):  # each section's figures were on disk as it ended, before the next ran
        assert "result" in seen[name][name] and list(seen[name]) == ALL_SECTIONS[:i + 1]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "gpu_check.md"]  # no checkpoints in --out
    assert {"tiny", "7b"} <= {p.name for p in work.iterdir()}

    parity = sections["parity_fp32"]["result"]
    assert parity["all_identical"] and parity["identical_fraction"] == 1.0 and parity["max_logprob_diff"] < 1e-3
    assert [r["case"] for r in parity["cases"]][-2:] == ["text (prefix hit)", "image (prefix hit)"]
    assert parity["cases"][-1]["cached_tokens"] > 0

    d = sections["decode_7b"]["result"]
    # The floor counts what a decode step reads: every parameter but the vision tower's (the LM head is the
    # embedding table here, read whole by the head, so the table counts once).
    from transformers import Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(work / "7b")
    nbytes = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    vision = nbytes(model.model.visual.parameters())
    assert vision > 0 and d["decode_weights"]["bytes"] == nbytes(model.parameters()) - vision
    assert d["decode_weights"]["excluded"]["vision tower"] == vision and d["decode_weights"]["lm_head_tied"]
    assert d["floor_ms"] == pytest.approx(1000 * d["decode_weights"]["bytes"] / sections["bandwidth"]["result"])
    # Per-step times are differences of two timings, (T(n) - T(1)) / (n - 1): on a loaded CPU with tiny
    # models they can come out negative, so the dry run checks that they were measured, not their sign.
    assert math.isfinite(d["tessera_b1_ms"]) and math.isfinite(d["hf_b1_ms"])
    assert math.isfinite(d["unfused_b1_ms"])  # the same step with TESSERA_TRITON_OPS=0, side by side
    assert "compiled_b1_ms" not in d  # --enable-torch-compile takes the CUDA graphs: not on a CPU
    assert set(d["tessera_step_ms"]) == set(d["hf_step_ms"]) == {"8"}
    assert d["cuda_graph"]["expected"] == [1, 2, 4, 8] and not d["cuda_graph"]["all_captured"]  # CPU: no graphs
    offline = sections["offline_a_7b"]["result"]
    assert offline["tessera"]["tok_s"] > 0 and offline["hf"]["tok_s"] > 0 and offline["ratio_vs_hf"] > 0
    serving = sections["serving_7b"]["result"]
    assert serving["num_completed"] == plan.serving_prompts and serving["num_failed"] == 0
    assert 0 < serving["device"]["device_idle_fraction"] < 1 and serving["device"]["device_busy_s"] > 0

    spec = sections["spec_oracle_7b"]["result"]  # ORACLE drafts beside plain decode, outputs compared
    assert spec["identical"] and spec["accept_length"] > 1 and spec["plain_tok_s"] > 0 and spec["spec_tok_s"] > 0
    lora = sections["lora_7b"]["result"]  # 4 adapters over 16 rows beside the base step (no graphs on a CPU)
    assert lora["batch"] == 16 and lora["adapters"] == 4 and not lora["cuda_graphs"]
    assert all(ms > 0 for ms in lora["step_ms"].values()) and lora["ratio_vs_base"]["base"] == 1.0
    overlap = sections["serving_7b_overlap"]["result"]  # the same load with the overlap scheduler
    assert overlap["flags"] == ["--enable-overlap-schedule"] and serving["flags"] == []
    assert overlap["num_completed"] == plan.serving_prompts and overlap["num_failed"] == 0

    verdicts = {t["target"].split(" ")[0] + " " + t["target"].split(" ")[1]: t["status"] for t in report["targets"]}
    assert len(report["targets"]) == 12 and set(verdicts.values()) <= {"met", "not met"}
    assert verdicts["fp32 greedy"] == "met" and verdicts["serving random"] == "met"
    assert verdicts["CUDA graphs"] == "not met" and verdicts["bf16 identical-token"] == "not met"  # neither on a CPU
    assert _saved(out)["targets"] == report["targets"]
    md = (out / "gpu_check.md").read_text()
    for t in report["targets"]:
        assert f"- **{t['status']}**: {t['target']}" in md
    assert "| 7b | float32 |" in md and "excluded: vision tower" in md and "~8,800" in md


def test_the_budget_cuts_inside_a_section_and_the_rest_is_skipped(tmp_path, monkeypatch) -> None:
    now = [0.0]
    built = []

    def fake_build(path: Path, *args, **kwargs) -> Path:  # a checkpoint that takes 130 s of the fake clock
        built.append(path.name)
        path.mkdir(parents=True)
        now[0] += 130
        return path

    monkeypatch.setattr(gpu_sections, "build_checkpoint", fake_build)
    monkeypatch.setattr("tessera.demo.build_vl.build_skeleton", lambda path: None)
    monkeypatch.setattr(gpu_check, "ENTRY_MODULES", ("json",))  # the imports are the dry run's to check
    monkeypatch.setitem(gpu_sections.NEEDS_S, "bandwidth", 25)  # more than the 20 s left: no 2 GiB copy here
    # The real sizes' estimates: with 20 s left the 7b checkpoint (60 s) and parity (30 s) do not fit.
    plan = Plan.make("cpu", tiny=False, budget_s=150)
    out = tmp_path / "out"
    report = run(out, plan, tmp_path / "work", log=lambda *_: None, clock=lambda: now[0])
    s = report["sections"]
    assert built == ["tiny"] and list(s["checkpoints"]["result"]) == ["tiny"]
    assert len(s["checkpoints"]["cut"]) == 1 and s["checkpoints"]["cut"][0].startswith("checkpoint 7b: not started")
    assert "skipped" in s["parity_fp32"] and "needs about 30 s" in s["parity_fp32"]["skipped"]
    assert all("skipped" in s[name] for name in ("bandwidth", "decode_7b", "offline_a_7b", "serving_7b", "spec_oracle_7b",
                                                  "lora_7b", "serving_7b_overlap", "decode_2b"))
    assert _saved(out)["sections"]["checkpoints"]["cut"] == s["checkpoints"]["cut"]
    md = (out / "gpu_check.md").read_text()
    assert "Cut by the budget" in md and "checkpoints: checkpoint 7b: not started" in md
    assert len(report["targets"]) == 12 and all(t["status"] == "not met" for t in report["targets"])


def test_budget_records_a_part_it_does_not_start() -> None:
    now = [0.0]
    budget = Budget(10, clock=lambda: now[0])
    assert budget.allows("a", 5) and not budget.cuts
    now[0] = 7
    assert not budget.allows("b", 5) and budget.cuts == ["b: not started, 3 s left, needs about 5 s"]


def test_the_decode_floor_counts_the_language_model_and_its_head(tmp_path) -> None:
    from safetensors.torch import save_file

    def write(tensors: dict[str, int]) -> Path:
        save_file({k: torch.zeros(n) for k, n in tensors.items()}, tmp_path / "model.safetensors")
        return tmp_path

    lm = {"model.layers.0.mlp.weight": 100, "model.norm.weight": 4}
    untied = decode_weight_bytes(write({**lm, "model.visual.blocks.0.w": 50, "model.embed_tokens.weight": 30,
                                        "lm_head.weight": 30}))
    assert untied["bytes"] == 4 * (100 + 4 + 30) and not untied["lm_head_tied"]
    assert untied["excluded"] == {"vision tower": 4 * 50, "embedding table (row gather)": 4 * 30}
    tied = decode_weight_bytes(write({**lm, "model.visual.blocks.0.w": 50, "model.embed_tokens.weight": 30}))
    assert tied["bytes"] == 4 * (100 + 4 + 30) and tied["lm_head_tied"]


@pytest.mark.parametrize("effective, captured, reason", [
    ({"cuda_graph_batch_sizes": [1, 2, 4, 8, 16], "cuda_graph_status": "captured"}, True, None),
    ({"cuda_graph_batch_sizes": [], "cuda_graph_status": "capture failed, decode runs eagerly: decode batch size "
      "16: RuntimeError: int64 lengths"}, False, "capture failed"),
    ({"cuda_graph_batch_sizes": [1, 2, 4, 8], "cuda_graph_status": "captured"}, False, "some buckets not captured"),
    ({"cuda_graph_batch_sizes": [], "cuda_graph_status": "off: device cpu"}, False, "off: device cpu"),
    ({}, False, "unknown"),
])
def test_the_graph_report_reads_the_workers_status(effective, captured, reason) -> None:
    g = graph_report({"max_running_requests": 16, "cuda_graph_max_bs": None, "effective": effective})
    assert g["expected"] == [1, 2, 4, 8, 16] and g["all_captured"] is captured
    assert (g["reason"] is None) if reason is None else g["reason"].startswith(reason)


def test_the_command_refuses_a_work_dir_inside_out(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit):
        gpu_check.main(["--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "out" / "ckpt"),
                        "--device", "cpu"])
    assert "--work-dir" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_preflight_names_what_is_missing(tmp_path, monkeypatch) -> None:
    # A carried wheel installed without one of its dependencies: importing it names the one that is absent.
    (tmp_path / "carried_pkg.py").write_text("import no_such_dependency_here\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match=r"no-such-dependency-here \(for carried_pkg\)"):
        gpu_check.preflight("cpu", ("json", "carried_pkg"))
