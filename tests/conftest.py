"""Fixtures shared across test folders, and how the suite splits over pytest-xdist workers."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tessera.config import ASSETS_DIR

EXAMPLE_IMAGE = ASSETS_DIR / "examples" / "scene.png"
EXAMPLE_VIDEO = ASSETS_DIR / "examples" / "moving.mp4"
# demo-vl's template plus Qwen's tool block: renders exactly like demo-vl's own when no tools are given.
TOOL_TEMPLATE = Path(__file__).parent / "server" / "tool_chat_template.jinja"

# Session fixtures that start a server or an engine, or build checkpoints. `make test` runs two pytest-xdist
# workers with `--dist loadfile`, which keeps every file that names one on the same worker, so each is built once
# per run, not once per worker. A file that uses one without naming it only costs a second copy on the other
# worker: each worker has its own tmp_path_factory directory and servers take free ports.
SHARED_GROUPS = {"vl_server": "demo-vl-server", "demo_asr_server": "demo-vl-server",
                 "demo_vl_engine": "demo-vl-engine", "tiny_gqa": "tiny-qwen2-vl", "tiny_mha": "tiny-qwen2-vl",
                 "vl_case": "qwen2-vl-case"}
ROOT = Path(__file__).resolve().parents[1]


# Files of a minute or more (measured with --durations): they start first, so that with a file per worker the run
# does not end on one of them while the other worker has nothing left (the suite's tail was ~1.5 minutes).
SLOW_FILES_FIRST = ("tests/distributed/", "tests/server/test_fuzz.py", "tests/bench/test_gpu_check.py",
                    "tests/server/test_reliability.py", "tests/bench/test_end_to_end.py",
                    "tests/models/test_family_parity.py", "tests/lora/test_lora_vl_families.py")
# Files that run every family (parametrised by it: "family" or "family-spec" first in the test id) whose fixtures
# are per family: each family is its own unit, so the families spread over the workers instead of one file's
# families running one after another on one worker (the family parity suite alone was minutes of one worker).
SPLIT_BY_FAMILY = ("tests/models/test_family_parity.py", "tests/lora/test_lora_vl_families.py",
                   "tests/distributed/test_tp_families.py")


def pytest_configure(config):
    # Nothing here downloads: a test that tried would fail fast instead of waiting on the network. (Set before the
    # warm interpreter imports huggingface_hub, which reads it then; bench code sets it too, as a default.)
    os.environ["HF_HUB_OFFLINE"] = "1"
    if os.environ.get("TESSERA_TEST_COLD_SPAWN") != "1":
        from tests import warm_spawn

        warm_spawn.install()


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not item.nodeid.startswith(SLOW_FILES_FIRST))  # stable: the rest keep their order


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown (and unused) without pytest-xdist
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, with the files that share an expensive session fixture as one unit and the files that run
    every family split by family (SPLIT_BY_FAMILY). (xdist's own
    `loadgroup` would do it from marks, but its node-id suffix no longer reaches pytest 9's node ids.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedFixtureScheduling(LoadFileScheduling):
        group_of_file: dict[str, str] = {}

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            if path in SPLIT_BY_FAMILY and "[" in nodeid:
                return f"{path}::{nodeid.split('[', 1)[1].split('-', 1)[0].rstrip(']')}"
            if path not in self.group_of_file:
                try:
                    text = (ROOT / path).read_text()
                except OSError:
                    text = ""
                found = [group for name, group in SHARED_GROUPS.items() if re.search(rf"\b{name}\b", text)]
                self.group_of_file[path] = found[0] if found else path
            return self.group_of_file[path]

    return SharedFixtureScheduling(config, log)


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
