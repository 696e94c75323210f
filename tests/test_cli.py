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


def test_serve_exits_with_one_line_when_the_model_fails_to_load(tmp_path) -> None:
    """Weights that do not match: `tessera serve` stops within seconds, exit 2, one error line, no traceback."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tessera.config import ASSETS_DIR
    from tests.server.server_process import free_port

    broken = tmp_path / "broken"
    shutil.copytree(ASSETS_DIR / "demo-vl", broken)
    weights = load_file(broken / "model.safetensors")
    weights.pop(next(k for k in weights if k.endswith("down_proj.weight")))
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    out = run_cli("serve", "--model-path", str(broken), "--port", str(free_port()), timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "model failed to load: WeightLoadError" in errors[0]


def test_any_error_is_one_line_unless_debug(monkeypatch, capsys) -> None:
    """A chained RuntimeError from deep inside prints one `error:` line (exit 1); --log-level debug adds the
    traceback."""
    from tessera import cli

    def explode(ns):
        try:
            raise KeyError("inner")
        except KeyError as e:
            raise RuntimeError("scheduler step failed\nsecond line") from e

    monkeypatch.setattr(cli, "_cmd_generate", explode)
    for level, traceback_shown in (("info", False), ("debug", True)):
        with pytest.raises(SystemExit) as info:
            cli.main(["generate", "--log-level", level])
        err = capsys.readouterr().err
        assert info.value.code == 1
        assert [line for line in err.splitlines() if line.startswith("error:")] == [
            "error: RuntimeError: scheduler step failed"]
        assert ("Traceback" in err) is traceback_shown
        if not traceback_shown:
            assert len(err.strip().splitlines()) == 1
