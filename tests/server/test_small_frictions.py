"""Small frictions a new user met (issue 63): a video sent as an image gets a hint naming video_url and the
field; `tessera generate --image clip.mp4` is refused before the model loads; an adapter's answer names the
adapter; the port-in-use hint names make's PORT=."""

from __future__ import annotations

import base64
import socket
import subprocess
import sys

import pytest

from tessera.config import ASSETS_DIR
from tests.server.stub_app import stub_client

VIDEO = ASSETS_DIR / "examples" / "moving.mp4"


def test_a_video_sent_as_an_image_names_video_url_and_the_field():
    url = "data:image/png;base64," + base64.b64encode(VIDEO.read_bytes()).decode()
    with stub_client() as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "What moves?"}]}]})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "video_url" in err["message"] and err["param"] == "messages"
        r = client.post("/generate", json={"text": "<|vision_start|><|image_pad|><|vision_end|>Hi",
                                           "image_data": url})
        assert r.status_code == 400 and r.json()["error"]["param"] == "image_data", r.text


def test_generate_refuses_a_video_as_image_before_loading():
    out = subprocess.run([sys.executable, "-m", "tessera", "generate", "--image", str(VIDEO)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and "--video" in out.stderr and "Traceback" not in out.stderr


def test_an_adapters_answer_names_the_adapter():
    with stub_client() as client:
        serving = client.app.state.tessera.serving
        assert serving.answer_model(None, "unknown") == "demo-vl"
        assert serving.answer_model("poet", "demo-vl:poet") == "demo-vl:poet"
        assert serving.answer_model("poet", None) == "poet"


def test_port_in_use_hint_names_make_serve(monkeypatch):
    from tessera.entrypoints.http_server import check_port_free

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(ValueError, match=r"--port \(PORT=N with make serve\)"):
            check_port_free("127.0.0.1", s.getsockname()[1])
