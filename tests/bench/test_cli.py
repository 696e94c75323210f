"""`tessera bench ...` help and user errors, through the real `tessera` entry point."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tessera", "bench", *args], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("args,expected", [
    ((), ["serving", "offline", "profile"]),
    (("serving",), ["--base-url", "--request-rate", "--max-concurrency", "--image-resolution", "--from-json"]),
    (("offline",), ["--model-path", "--workload", "--compare", "--num-runs"]),
])
def test_help(args: tuple[str, ...], expected: list[str]) -> None:
    out = run_cli(*args, "--help")
    assert out.returncode == 0, out.stderr
    for flag in expected:
        assert flag in out.stdout


@pytest.mark.parametrize("args,field", [
    (("serving", "--dataset", "random-audio", "--audio-seconds", "0", "--base-url", "http://127.0.0.1:9"),
     "audio_seconds"),
    (("serving",), "base_url"),
    (("serving", "--plot", "x.png"), "plot"),
    (("offline", "--workload", "e"), "workload"),
    (("profile", "--batch-size", "0"), "batch_size"),
])
def test_user_errors_are_one_line(args: tuple[str, ...], field: str) -> None:
    out = run_cli(*args)
    assert out.returncode == 2
    assert field in out.stderr and "Traceback" not in out.stderr

