"""Servers shared by the server tests: the bundled speech model, and demo-vl (one per session)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.config import ASSETS_DIR
from tests.server.server_process import ServerProcess

EXAMPLE_IMAGE = ASSETS_DIR / "examples" / "scene.png"
EXAMPLE_VIDEO = ASSETS_DIR / "examples" / "moving.mp4"
# demo-vl's template plus Qwen's tool block: renders exactly like demo-vl's own when no tools are given.
TOOL_TEMPLATE = Path(__file__).with_name("tool_chat_template.jinja")


@pytest.fixture(scope="session")
def demo_asr_server():
    srv = ServerProcess("--model-path", "demo-asr")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def vl_media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "scene.png").write_bytes(EXAMPLE_IMAGE.read_bytes())
    (d / "moving.mp4").write_bytes(EXAMPLE_VIDEO.read_bytes())
    return d


@pytest.fixture(scope="session")
def vl_server(vl_media_dir):
    """demo-vl with local media allowed and a tool-capable chat template."""
    srv = ServerProcess("--model-path", "demo-vl", "--allowed-local-media-path", str(vl_media_dir),
                        "--allow-private-media-urls", "--max-total-tokens", "16384",
                        "--chat-template", str(TOOL_TEMPLATE))
    yield srv
    srv.stop()
