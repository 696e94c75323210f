"""Servers shared by the server tests: the bundled speech model (one per session). demo-vl's server is in
tests/conftest.py (other folders use it too)."""

from __future__ import annotations

import pytest

from tests.conftest import EXAMPLE_IMAGE, EXAMPLE_VIDEO, TOOL_TEMPLATE  # noqa: F401  (re-exported)
from tests.server.server_process import ServerProcess


@pytest.fixture(scope="session")
def demo_asr_server():
    srv = ServerProcess("--model-path", "demo-asr")
    yield srv
    srv.stop()
