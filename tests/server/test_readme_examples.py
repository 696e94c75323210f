"""The README's examples work as written (only the port is changed to a free one)."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.server.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--model-path", "demo-vl")
    yield srv
    srv.stop()


def test_curl_example(server, monkeypatch):
    (curl,) = [b for b in blocks("bash") if "curl" in b]
    script = curl.replace("127.0.0.1:30000", f"127.0.0.1:{server.port}")
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    expected = re.search(r'"content": "(\w+)"\}', curl).group(1)
    assert reply["choices"][0]["message"]["content"] == expected


def test_python_examples(server, monkeypatch):
    monkeypatch.chdir(ROOT)
    for code in blocks("python"):
        expected = re.search(r"#\s*(\w+)", code.strip().splitlines()[-1]).group(1)
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(code.replace("127.0.0.1:30000", f"127.0.0.1:{server.port}"), "README", "exec"), {})
        assert buf.getvalue().split()[0] == expected, buf.getvalue()
