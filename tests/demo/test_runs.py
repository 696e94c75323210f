"""The demo scripts' shared run plumbing: resumable state, time budget, reported results."""

from __future__ import annotations

import json
import time

import torch

from demo.runs import load_state, out_of_time, report, resume, save_state


def test_state_round_trips_and_the_log_is_readable(tmp_path) -> None:
    assert load_state(tmp_path) is None
    log = [{"step": 10, "loss": 1.5}]
    save_state(tmp_path, {"model": {"w": torch.ones(2)}, "step": 10}, log)
    log.append({"step": 20, "loss": 1.0})
    save_state(tmp_path, {"model": {"w": torch.zeros(2)}, "step": 20}, log)
    state = load_state(tmp_path)
    assert state is not None and state["step"] == 20 and state["log"] == log
    assert torch.equal(state["model"]["w"], torch.zeros(2))
    assert json.loads((tmp_path / "log.json").read_text()) == log
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "log.json"]  # no temporary left behind


def test_resume_loads_each_part(tmp_path, capsys) -> None:
    assert resume(tmp_path, model=torch.nn.Linear(2, 2)) == (0, [], None)
    saved, fresh = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    save_state(tmp_path, {"model": saved.state_dict(), "step": 7}, [{"step": 7}])
    step, log, state = resume(tmp_path, model=fresh)
    assert (step, log) == (7, [{"step": 7}]) and state is not None
    assert torch.equal(fresh.weight, saved.weight)
    assert "resumed at step 7" in capsys.readouterr().out


def test_out_of_time_only_past_the_budget(capsys) -> None:
    assert not out_of_time(time.time(), max_minutes=1.0)
    assert capsys.readouterr().out == ""
    assert out_of_time(time.time() - 61, max_minutes=1.0)
    assert "time budget reached" in capsys.readouterr().out


def test_report_prints_and_writes(tmp_path, capsys) -> None:
    result = {"accuracy": 0.5, "seconds": 1.2}
    report(result, None)
    assert json.loads(capsys.readouterr().out) == result
    path = tmp_path / "out.json"
    report(result, str(path))
    assert json.loads(path.read_text()) == result
