"""The `tessera` command line: help, and clear errors (no tracebacks) for bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tessera", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_help_lists_subcommands() -> None:
    out = run_cli("--help")
    assert out.returncode == 0
    for sub in ("serve", "generate", "bench"):
        assert sub in out.stdout


@pytest.mark.parametrize("sub", ["serve", "generate"])
def test_subcommand_help(sub: str) -> None:
    out = run_cli(sub, "--help")
    assert out.returncode == 0 and "--model-path" in out.stdout


def test_unknown_model_path_is_a_clear_error(tmp_path) -> None:
    out = run_cli("generate", "--model-path", str(tmp_path / "nope"))
    assert out.returncode == 2
    assert "model_path" in out.stderr and "Traceback" not in out.stderr


def test_unreadable_image_is_a_clear_error(tmp_path) -> None:
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"this is not a png")
    out = run_cli("generate", "--image", str(bad), "--max-new-tokens", "4")
    assert out.returncode == 2, out.stderr
    assert "image" in out.stderr.lower() and "Traceback" not in out.stderr


def test_generate_answers_about_the_bundled_image() -> None:
    out = run_cli("generate", "--prompt", "How many shapes are there?", "--max-new-tokens", "8")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "three"
