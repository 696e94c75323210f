"""Fixtures shared across test folders, and how the suite splits over pytest-xdist workers."""

from __future__ import annotations

from pathlib import Path

import pytest

from tessera.config import ASSETS_DIR

EXAMPLE_IMAGE = ASSETS_DIR / "examples" / "scene.png"
EXAMPLE_VIDEO = ASSETS_DIR / "examples" / "moving.mp4"
# demo-vl's template plus Qwen's tool block: renders exactly like demo-vl's own when no tools are given.
TOOL_TEMPLATE = Path(__file__).parent / "server" / "tool_chat_template.jinja"

# Session fixtures that start a server or an engine, or build checkpoints: every file that uses one runs on
# the same xdist worker (`--dist loadgroup`), so each is built once per run, not once per worker.
SHARED_GROUPS = {"vl_server": "demo-vl-server", "demo_asr_server": "demo-vl-server",
                 "demo_vl_engine": "demo-vl-engine", "tiny_gqa": "tiny-qwen2-vl", "tiny_mha": "tiny-qwen2-vl",
                 "vl_case": "qwen2-vl-case"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    """Each file is one xdist group (module fixtures are built once), and files that share an expensive session
    fixture are one group. Without xdist the marks change nothing."""
    group_of_file: dict[str, str] = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        for name in item.fixturenames:
            if name in SHARED_GROUPS:
                group_of_file.setdefault(path, SHARED_GROUPS[name])
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            path = item.nodeid.split("::")[0]
            item.add_marker(pytest.mark.xdist_group(group_of_file.get(path, path)))


@pytest.fixture(scope="session")
def demo_vl_engine():
    """One offline Engine on the bundled demo-vl for the structured-output and tessera.lang tests. Small
    prefill chunks and KV pool on purpose: an image prompt is prefilled in several chunks, and a handful of
    concurrent requests runs the pool dry, so requests are retracted and resumed."""
    from tessera import Engine

    with Engine("demo-vl", max_total_tokens=384, chunked_prefill_size=48, max_running_requests=16,
                show_progress=False) as engine:
        yield engine


@pytest.fixture(scope="session")
def vl_media_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("media")
    (d / "scene.png").write_bytes(EXAMPLE_IMAGE.read_bytes())
    (d / "moving.mp4").write_bytes(EXAMPLE_VIDEO.read_bytes())
    return d


@pytest.fixture(scope="session")
def vl_server(vl_media_dir):
    """The one demo-vl `tessera serve` of the session, shared by every test that needs plain demo-vl behind
    HTTP: local media allowed, private media URLs allowed, 16,384 KV tokens and a tool-capable chat template
    (the union of what those tests need; none of these flags changes a plain request's answer)."""
    from tests.server.server_process import ServerProcess

    srv = ServerProcess("--model-path", "demo-vl", "--allowed-local-media-path", str(vl_media_dir),
                        "--allow-private-media-urls", "--max-total-tokens", "16384",
                        "--chat-template", str(TOOL_TEMPLATE))
    yield srv
    srv.stop()
