"""A `tessera serve --model-path demo-asr` shared by the server tests that need the bundled speech model."""

from __future__ import annotations

import pytest

from tests.server.server_process import ServerProcess


@pytest.fixture(scope="session")
def demo_asr_server():
    srv = ServerProcess("--model-path", "demo-asr")
    yield srv
    srv.stop()
