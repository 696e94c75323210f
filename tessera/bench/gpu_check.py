"""One-command GPU check: `python -m tessera.bench.gpu_check --out DIR` (one GPU, within --budget-s, 420 s).

Builds random-weight Qwen2-VL checkpoints with demo-vl's tokenizer and processor under --work-dir (a tiny one
for parity, a 7B-sized and a 2B-sized one for speed; the vocabulary is demo-vl's 576 tokens, so the
embedding table, which is also the LM head, is small), then measures, side by side in one run:

1. preflight: the modules the sections import (what to carry to a machine that lacks them);
2. parity with HF transformers on the device: fp32 on the tiny config token-identical (images, video, a
   batch, chunked prefill, a prefix-cache hit); bf16 the fraction of identical greedy tokens and the max
   difference of the chosen tokens' logprobs;
3. the device's copy bandwidth and the decode floor it implies per model: the bytes a decode step reads (the
   language model with its LM head; not the vision tower, not the embedding rows gathered) / bandwidth;
4. batch-1 decode ms per token, Tessera vs HF vs the floor; Tessera's decode step at batch 8, 32, 64 and
   HF's at the largest; the CUDA graphs the engine reports captured;
5. `tessera bench offline` workload a, Tessera vs HF output tok/s;
6. `tessera bench serving` random-image 448x448 at concurrency 64 against a `tessera serve` subprocess;
7. speculative decoding's verify step with ORACLE drafts (issue 49), and 16 decode rows over 4 LoRA adapters
   against the base step, both through CUDA graphs (issue 50; tessera/bench/lora.py).

DIR/gpu_check.json and DIR/gpu_check.md are rewritten as each section starts and ends, so a run killed
from outside leaves what finished (and which section was running). Each ends with issue 30's targets, met
or not met. The budget is asked before each section and inside them, before each long part (see
gpu_sections.py); what it cut is recorded. A failing section records its error and the next one runs; the
exit status is 1 when a section failed or (on a GPU) a target is not met. `--device cpu --tiny` runs every
section on tiny sizes on a CPU (the dry run tests/bench/test_gpu_check.py makes).

Needs only torch, transformers and the project's own small dependencies (no PyAV: video arrives as
frames); ../shared/gpu/device-run.sh runs it on a lent GPU machine.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tessera.bench import gpu_sections as sec
from tessera.bench import lora as lora_bench
from tessera.bench.gpu_report import MET, markdown, targets
from tessera.platform.device import resolve_device

# What the sections import, and what `tessera serve` (the serving section's subprocess) imports at start.
ENTRY_MODULES = ("tessera.entrypoints.engine", "tessera.entrypoints.http_server", "tessera.bench.offline",
                 "tessera.bench.hf_baseline", "tessera.bench.serving", "tessera.bench.report", "tessera.demo.build_vl",
                 "transformers.models.qwen2_vl.modeling_qwen2_vl", "safetensors", "httpx")
PIP_NAMES = {"PIL": "pillow", "zmq": "pyzmq", "yaml": "pyyaml", "opentelemetry": "opentelemetry-api",
             "multipart": "python-multipart", "python_multipart": "python-multipart", "annotated_doc": "annotated-doc",
             "pydantic_core": "pydantic-core", "typing_inspection": "typing-inspection",
             "prometheus_client": "prometheus-client"}


def preflight(device: str, modules: tuple[str, ...] | None = None) -> dict:
    """Imports what the sections and `tessera serve` need, once each; raises naming the packages missing (the
    first one missing per module: a carried wheel installed without its dependencies shows up here)."""
    modules = ENTRY_MODULES if modules is None else modules
    missing: dict[str, str] = {}  # package -> the module that needed it
    for name in (*modules, *(("triton",) if device.startswith("cuda") else ())):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            top = (e.name or name).split(".")[0]
            missing.setdefault(PIP_NAMES.get(top, top.replace("_", "-")), name)
    if missing:
        raise RuntimeError(f"missing Python packages: {', '.join(f'{p} (for {m})' for p, m in missing.items())}; "
                           f"carry their wheels: EXTRA_WHEELS=\"{' '.join(missing)}\" ../shared/gpu/fetch-wheels.sh")
    return {"imported": list(modules), "optional": {m: importlib.util.find_spec(m) is not None
                                                     for m in ("torchvision", "av", "flash_attn")}}


def _write(out_dir: Path, report: dict) -> None:
    """Both files, each replaced whole (a run killed mid-write keeps the previous complete file)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("gpu_check.json", json.dumps(report, indent=2, default=str)),
                       ("gpu_check.md", markdown(report))):
        tmp = out_dir / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, out_dir / name)


def _free_device_memory(device: str) -> None:
    """What a section's models held goes back to the device, for the next section's engine to size its pool."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run(out_dir: Path, plan: sec.Plan, work_dir: Path, log: Callable[[str], Any] = print,
        clock: Callable[[], float] = time.monotonic) -> dict:
    """Every section in turn, within plan.budget_s; checkpoints go to work_dir, results to out_dir."""
    out_dir, work_dir = Path(out_dir), Path(work_dir)
    budget = sec.Budget(plan.budget_s, clock)
    report: dict[str, Any] = {
        "device": plan.device, "tiny": plan.tiny, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "torch": torch.__version__, "python": platform.python_version(), "budget_s": plan.budget_s,
        "gpu": torch.cuda.get_device_name() if plan.device.startswith("cuda") else None, "sections": {}}
    models: dict[str, Path] = {}
    bandwidth: dict[str, float] = {}

    def save() -> None:
        report["seconds"] = round(plan.budget_s - budget.left(), 1)
        report["targets"] = targets(report)
        _write(out_dir, report)

    def section(name: str, fn: Callable[[], Any], models_needed: tuple[str, ...] = (),
                needs_bandwidth: bool = False) -> None:
        absent = [m for m in models_needed if m not in models] + (["bandwidth"] if needs_bandwidth and not
                                                                  bandwidth else [])
        if absent:
            report["sections"][name] = {"skipped": f"no {', '.join(absent)} (not built or measured)"}
        elif budget.left() < plan.needs(name) or budget.left() <= 0:
            report["sections"][name] = {"skipped": f"{budget.left():.0f} s left, needs about {plan.needs(name):.0f} s"}
        else:
            report["sections"][name] = {"running": True}
            save()
            budget.cuts = []
            t = time.monotonic()
            try:
                report["sections"][name] = {"result": fn()}
            except Exception as e:  # one broken section must not hide the others' figures
                report["sections"][name] = {"error": f"{type(e).__name__}: {e}",
                                            "trace": traceback.format_exc()[-3000:]}
            finally:
                _free_device_memory(plan.device)
            s = report["sections"][name]
            s["seconds"] = round(time.monotonic() - t, 1)
            if budget.cuts:
                s["cut"] = budget.cuts
        save()
        s = report["sections"][name]
        log(f"[gpu_check] {name}: " + (f"skipped ({s['skipped']})" if "skipped" in s else f"{s['seconds']} s")
            + (f" ERROR {s['error']}" if "error" in s else "") + "".join(f"; cut {c}" for c in s.get("cut", [])))

    section("preflight", lambda: preflight(plan.device))
    section("checkpoints", lambda: sec.build_checkpoints(work_dir, plan, budget, models))
    section("parity_fp32", lambda: sec.parity(models["tiny"], plan, "float32", budget), ("tiny",))
    if plan.device != "cpu":
        section("parity_bf16", lambda: sec.parity(models["tiny"], plan, "bfloat16", budget), ("tiny",))
    section("bandwidth", lambda: bandwidth.setdefault("bytes_per_s", sec.copy_bandwidth(plan.device, plan.tiny)))
    speed = lambda name: lambda: sec.decode_speed(models[name], plan, bandwidth["bytes_per_s"], budget)  # noqa: E731
    if "7b" in plan.speed_models:
        section("decode_7b", speed("7b"), ("7b",), needs_bandwidth=True)
        section("offline_a_7b", lambda: sec.offline_a(models["7b"], plan, budget), ("7b",))
        section("serving_7b", lambda: sec.serving(models["7b"], plan, budget), ("7b",))
        section("spec_oracle_7b", lambda: sec.speculative_oracle(models["7b"], plan), ("7b",))
        section("lora_7b", lambda: lora_bench.gpu_section(models["7b"], plan), ("7b",))
        # The same load with the overlap scheduler (issue 48: TPOT p50 <= 1.3x the batch-64 step); last, so that a
        # short budget cuts it before the sections above.
        section("serving_7b_overlap", lambda: sec.serving(models["7b"], plan, budget, "--enable-overlap-schedule"),
                ("7b",))
    for name in plan.speed_models:
        if name != "7b":
            section(f"decode_{name}", speed(name), (name,), needs_bandwidth=True)
    for t in report["targets"]:
        log(f"[gpu_check] target {t['status']}: {t['target']} ({t['detail']})")
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tessera.bench.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory for gpu_check.json and gpu_check.md (kept small)")
    parser.add_argument("--device", default="cuda", help="cuda[:N], or cpu for a dry run")
    parser.add_argument("--tiny", action="store_true", help="dry run: every section on tiny sizes")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="seconds for the whole run; sections and their parts that would not fit are cut")
    parser.add_argument("--work-dir", default=None,
                        help="where the checkpoints go (default: a temporary directory); not inside --out")
    parser.add_argument("--keep-checkpoints", action="store_true", help="leave the work dir in place")
    args = parser.parse_args(argv)
    if args.budget_s <= 0:
        parser.error(f"--budget-s: must be positive, got {args.budget_s}")
    out = Path(args.out).resolve()
    work = Path(args.work_dir).resolve() if args.work_dir else Path(tempfile.mkdtemp(prefix="tessera-gpu-check-"))
    if work == out or out in work.parents or work in out.parents:
        parser.error(f"--work-dir: {work} must be neither inside --out {out} (which is copied back and must stay "
                     "small) nor contain it")
    if args.device.startswith("cuda"):
        # That GPU for this process's own tensors too; resolve_device gives `cuda` its index (set_device needs one).
        torch.cuda.set_device(resolve_device(args.device))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        report = run(out, sec.Plan.make(args.device, args.tiny, args.budget_s), work)
    finally:
        if not args.keep_checkpoints:
            shutil.rmtree(work, ignore_errors=True)
    print((out / "gpu_check.md").read_text())
    failed = [k for k, v in report["sections"].items() if "error" in v]
    unmet = [t["target"] for t in report["targets"] if t["status"] != MET]
    if failed:
        print(f"sections with errors: {', '.join(failed)}", file=sys.stderr)
    if unmet and not args.tiny:
        print(f"targets not met: {'; '.join(unmet)}", file=sys.stderr)
    if failed or (unmet and not args.tiny):
        sys.exit(1)


if __name__ == "__main__":
    main()
