"""What `make serve` sets up, and that the package imports from a script run in the clone's parent folder."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_make_serve_installs_only_what_serving_needs_and_shows_progress() -> None:
    """`make -n -B serve` lists the set-up commands without running them: the package without the test extras,
    pip's progress on (never -q for the install), and a line saying what the first set-up costs."""
    out = subprocess.run(["make", "-n", "-B", "serve"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    installs = [line for line in out.stdout.splitlines() if "pip install" in line and "-e " in line]
    assert installs and all("[test]" not in line and " -q " not in line for line in installs), installs
    assert "--progress-bar on" in installs[0]
    assert "first time only" in out.stdout and "GB" in out.stdout
    test = subprocess.run(["make", "-n", "-B", "test"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert "'.[test]'" in test.stdout  # the test tools come with `make test`


def test_a_script_in_the_clones_parent_folder_imports_the_package(tmp_path) -> None:
    """A clone named `tessera` seen from its parent folder is a folder without __init__.py: with setuptools'
    default editable install Python took it for an empty namespace package (`no attribute 'Engine'`)."""
    (tmp_path / "tessera").symlink_to(ROOT)
    out = subprocess.run([sys.executable, "-c", "import tessera; print(tessera.Engine.__name__)"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "Engine", out.stderr[-2000:]
