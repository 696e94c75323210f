"""What the demo's training and evaluation scripts share: the resumable state in the work dir, the time budget,
and how a result is reported."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from tessera.bench.cli import report_result


def load_state(work_dir: Path) -> dict[str, Any] | None:
    """The state `save_state` last wrote in work_dir, or None for a fresh run."""
    ckpt = work_dir / "ckpt.pt"
    return torch.load(ckpt, weights_only=False) if ckpt.exists() else None


def resume(work_dir: Path, **parts: Any) -> tuple[int, list[dict], dict[str, Any] | None]:
    """(step, log, state) of the state last saved in work_dir, each of `parts` (a module or an optimizer, named
    by its key in the state) loaded from it; (0, [], None) for a fresh run."""
    state = load_state(work_dir)
    if state is None:
        return 0, [], None
    for key, part in parts.items():
        part.load_state_dict(state[key])
    print(f"resumed at step {state['step']}", flush=True)
    return state["step"], state["log"], state


def save_state(work_dir: Path, state: dict[str, Any], log: list[dict]) -> None:
    """work_dir/ckpt.pt (`state` and the log), replaced atomically so that a killed run resumes from the last
    complete one, and the log again as work_dir/log.json for reading."""
    ckpt = work_dir / "ckpt.pt"
    tmp = ckpt.with_suffix(".tmp")
    torch.save({**state, "log": log}, tmp)
    tmp.rename(ckpt)
    (work_dir / "log.json").write_text(json.dumps(log, indent=1))


def out_of_time(t_start: float, max_minutes: float) -> bool:
    """Whether a run started at t_start has spent its budget (said on stdout; the caller saves and stops)."""
    if (time.time() - t_start) / 60 <= max_minutes:
        return False
    print("time budget reached; saving", flush=True)
    return True


def report(result: dict, output_json: str | None) -> None:
    """An evaluation's result on stdout, and at output_json when given."""
    report_result(json.dumps(result, indent=2), result, output_json)
