"""ruff and vulture over the tree, so that what issue 64 pruned stays pruned (configured in pyproject.toml).

ruff: pyflakes (unused imports and names, undefined names), syntax errors and bugbear's likely bugs, everywhere.
vulture: dead code in the package at 80% confidence. Below that it lists every FastAPI route, exception
handler, framework hook and model class reached by name (the family table imports them by string), so those
are looked at by hand (`vulture --min-confidence 60 tessera/`), not here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_ruff_finds_nothing() -> None:
    out = _run("ruff", "check", "--no-cache", "--output-format", "concise", ".")
    assert out.returncode == 0, out.stdout + out.stderr


def test_vulture_finds_no_dead_code_in_the_package() -> None:
    out = _run("vulture")  # paths and confidence from pyproject.toml
    assert out.returncode == 0, out.stdout + out.stderr


def test_the_checkers_can_fail(tmp_path) -> None:
    (tmp_path / "dead.py").write_text("import os\n\n\ndef f(x):\n    return x\n    print(x)\n")
    assert "F401" in _run("ruff", "check", "--no-cache", "--isolated", "--select", "F", str(tmp_path)).stdout
    found = _run("vulture", "--min-confidence", "80", str(tmp_path)).stdout
    assert "unused import 'os'" in found and "unreachable code after 'return'" in found, found
