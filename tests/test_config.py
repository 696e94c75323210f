"""ServerArgs: the scheduler's thread count (one core is left to the frontend unless told otherwise)."""

from __future__ import annotations

import os

import pytest

from tessera.config import ServerArgs


def test_default_threads_leave_one_core_to_the_frontend(monkeypatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert ServerArgs().scheduler_threads == 7
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert ServerArgs().scheduler_threads == 1
    assert ServerArgs(cpu_threads=3).scheduler_threads == 3


@pytest.mark.parametrize("bad", [0, -2, "two"])
def test_bad_thread_counts_are_refused(bad) -> None:
    with pytest.raises(ValueError, match="cpu_threads: must be a positive integer"):
        ServerArgs(cpu_threads=bad)
