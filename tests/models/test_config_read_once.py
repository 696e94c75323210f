"""Each process reads the checkpoint's config.json (ModelConfig.load) and generation_config.json once; the
rest of the process takes the ModelConfig."""

from __future__ import annotations

import builtins
import io
from collections import Counter
from pathlib import Path

import pytest

from tessera.config import ServerArgs
from tessera.models.config import ModelConfig, eos_token_ids


@pytest.fixture
def reads(monkeypatch) -> Counter:
    """Counts ModelConfig.load calls (key "ModelConfig.load") and opens of files by name."""
    counts: Counter = Counter()
    real_open, real_load = builtins.open, ModelConfig.load.__func__

    def counting_open(file, *args, **kwargs):
        if isinstance(file, (str, Path)):
            counts[Path(file).name] += 1
        return real_open(file, *args, **kwargs)

    def counting_load(cls, model_path, model_impl="auto"):
        counts["ModelConfig.load"] += 1
        return real_load(cls, model_path, model_impl)

    monkeypatch.setattr(builtins, "open", counting_open)
    monkeypatch.setattr(io, "open", counting_open)  # pathlib opens through io.open
    monkeypatch.setattr(ModelConfig, "load", classmethod(counting_load))
    return counts


def test_model_config_load_reads_each_file_once_and_eos_ids_read_none(reads) -> None:
    path = ServerArgs(model_path="demo-asr").model_path  # a checkpoint with a generation_config.json
    config = ModelConfig.load(path)
    assert (reads["config.json"], reads["generation_config.json"]) == (1, 1)
    assert config.generation_config and eos_token_ids(config)
    assert (reads["config.json"], reads["generation_config.json"]) == (1, 1)


def test_the_scheduler_process_reads_the_config_once(reads, tmp_path) -> None:
    from tessera.entrypoints.scheduler_process import build_scheduler

    args = ServerArgs.for_engine("demo-vl", max_total_tokens=2048, max_running_requests=4)
    scheduler = build_scheduler(args, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    try:
        assert scheduler.eos_ids and scheduler.worker.config is scheduler.config
        # Worker and scheduler take the ModelConfig; only the tokenizer load may read config.json for itself.
        assert reads["ModelConfig.load"] == 1 and reads["generation_config.json"] == 1
    finally:
        scheduler.recv_sock.close(linger=0)
        scheduler.send_sock.close(linger=0)


def test_the_frontend_reads_the_config_once(reads, monkeypatch) -> None:
    """launch_server reads it (to fail fast on an unsupported architecture) and hands it down to ModelInfo."""
    from tessera.entrypoints import http_server
    from tessera.frontend.model_info import ModelInfo

    handed: list[ModelConfig] = []

    async def serve(args, config):
        handed.append(http_server.create_app(args, config).state.tessera.config)
        return 0

    monkeypatch.setattr(http_server, "_serve", serve)
    args = ServerArgs(model_path="demo-vl")
    assert http_server.launch_server(args) == 0
    info = ModelInfo.load(args, handed[0])
    assert info.config is handed[0] and reads["ModelConfig.load"] == 1
