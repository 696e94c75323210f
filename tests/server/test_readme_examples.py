"""The README's examples, and docs/usage.md's Python ones, work as written (only the port is changed to a free
one)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
USAGE = (ROOT / "docs" / "usage.md").read_text()  # the README's tour in full: its longer examples


def blocks(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


@pytest.fixture(scope="module")
def server(vl_server):
    """The session's demo-vl server: its extra flags (local media, a tool template that renders like demo-vl's
    own without tools) change nothing the README's examples do."""
    return vl_server


def run_curl(marker: str, port: int) -> tuple[str, str]:
    """The README's bash block that calls `marker`, run against `port`: (its stdout, the block)."""
    (curl,) = [b for b in blocks("bash") if "curl" in b and marker in b]
    script = curl.replace("127.0.0.1:30000", f"127.0.0.1:{port}")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout, curl


def test_curl_example(server):
    stdout, curl = run_curl("/v1/chat/completions", server.port)
    expected = re.search(r'"content": "(\w+)"\}', curl).group(1)
    assert json.loads(stdout)["choices"][0]["message"]["content"] == expected


def test_transcription_curl_example(demo_asr_server):
    stdout, curl = run_curl("/v1/audio/transcriptions", demo_asr_server.port)
    expected = re.search(r'# -> \{"text":"([a-z ]+)"', curl).group(1)
    assert json.loads(stdout)["text"] == expected


def test_python_examples(server, monkeypatch):
    monkeypatch.chdir(ROOT)
    examples = blocks("python") + blocks("python", USAGE)
    assert len(examples) >= 8, "the README's and docs/usage.md's Python examples"
    for code in examples:
        expected = re.search(r"#\s*(\w+)", code.strip().splitlines()[-1]).group(1)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(code.replace("127.0.0.1:30000", f"127.0.0.1:{server.port}"), "README", "exec"), {})
        assert buf.getvalue().split()[0] == expected, buf.getvalue()
