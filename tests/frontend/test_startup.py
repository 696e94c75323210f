"""Start-up order: the scheduler processes start before the frontend loads its tokenizer and processor (so
the two overlap), and a frontend that then fails to load stops them: no scheduler outlives the error."""

from __future__ import annotations

import subprocess

import pytest

from tessera.config import ServerArgs
from tessera.frontend import scheduler_procs
from tessera.frontend.tokenizer_manager import TokenizerManager
from tessera.frontend.model_info import ModelInfo
from tessera.platform import launch


def test_a_frontend_that_fails_to_load_stops_the_schedulers_it_started(monkeypatch):
    started: list[subprocess.Popen] = []

    class RecordingPopen(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    def broken_processor(self):
        assert started and all(p.poll() is None for p in started)  # the scheduler is already starting
        raise RuntimeError("processor files are unreadable")

    monkeypatch.setattr(scheduler_procs, "spawn", launch.spawn)  # the real launcher, not the tests' warm one
    monkeypatch.setattr(scheduler_procs.subprocess, "Popen", RecordingPopen)
    monkeypatch.setattr(ModelInfo, "make_mm_processor", broken_processor)
    with pytest.raises(RuntimeError, match="processor files are unreadable"):
        TokenizerManager(ServerArgs.for_engine("demo-vl", dp_size=2))
    assert len(started) == 2  # one per data-parallel replica
    assert all(p.returncode is not None for p in started)  # stopped and reaped, not left running
