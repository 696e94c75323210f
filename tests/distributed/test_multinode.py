"""Two nodes on one machine (distinct --node-rank over loopback): one TP group of 2 spread over them."""

from __future__ import annotations

import base64
import subprocess
import sys

import httpx
import pytest

from tessera.config import ASSETS_DIR
from tests.server.server_process import ServerProcess, free_port

QUESTIONS = {"Describe the image.": "a red circle, a blue square and a green triangle",
             "How many shapes are there?": "three"}


def test_tp2_over_two_nodes_answers_as_one() -> None:
    addr = f"127.0.0.1:{free_port()}"
    common = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr, "--max-total-tokens", "4096"]
    node1 = subprocess.Popen([sys.executable, "-m", "tessera", "serve", "--model-path", "demo-vl", "--node-rank", "1",
                              *common], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    srv = None
    try:
        srv = ServerProcess("--model-path", "demo-vl", "--node-rank", "0", *common)
        image = "data:image/png;base64," + base64.b64encode(
            (ASSETS_DIR / "examples" / "scene.png").read_bytes()).decode()
        for question, answer in QUESTIONS.items():
            body = {"model": "demo-vl", "temperature": 0, "max_tokens": 16, "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": question}]}]}
            r = httpx.post(f"{srv.base_url}/v1/chat/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["message"]["content"] == answer
        assert httpx.get(f"{srv.base_url}/get_server_info", timeout=10).json()["effective"]["tp_size"] == 2
    finally:
        if srv is not None:
            srv.stop()
        # Node 1's rank sees node 0 go and exits; so does its `tessera serve`.
        out, _ = node1.communicate(timeout=30)
    assert node1.returncode == 0, out
    assert "Tessera node 1/2" in out


def test_bad_node_settings_are_one_line_errors() -> None:
    out = subprocess.run([sys.executable, "-m", "tessera", "serve", "--nnodes", "2", "--tp-size", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "dist_init_addr" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_a_dead_remote_rank_fails_health_and_stops_node_0() -> None:
    """Node 1's rank is killed while node 0 is idle: node 0 cannot see its process, only its heartbeat stop
    (distributed/heartbeat.py). Within seconds, without any request, /health stops answering 200 and node 0 exits
    1, as when one of its own ranks dies (was: /health 200 for good, every request a 500)."""
    import os
    import signal
    import time

    from tests.server.server_process import children_of

    addr = f"127.0.0.1:{free_port()}"
    common = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr, "--max-total-tokens", "4096"]
    node1 = subprocess.Popen([sys.executable, "-m", "tessera", "serve", "--model-path", "demo-vl", "--node-rank", "1",
                              *common], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    srv = None
    try:
        srv = ServerProcess("--model-path", "demo-vl", "--node-rank", "0", *common)
        body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        assert httpx.post(f"{srv.base_url}/v1/chat/completions", json=body, timeout=60).status_code == 200
        time.sleep(2 * 0.5 * 10)  # longer than the heartbeat timeout: an idle, healthy group stays up
        assert httpx.get(f"{srv.base_url}/health", timeout=5).status_code == 200
        for pid in children_of(node1.pid):
            os.kill(pid, signal.SIGKILL)
        node1.kill()
        node1.wait(timeout=30)
        killed = time.monotonic()
        while srv.proc.poll() is None and time.monotonic() < killed + 60:
            time.sleep(0.2)
        assert srv.proc.poll() == 1, srv.output()[-2000:]
        assert time.monotonic() - killed < 20
        assert "stopped answering" in srv.output()
    finally:
        if srv is not None:
            srv.stop()
        if node1.poll() is None:
            node1.kill()
