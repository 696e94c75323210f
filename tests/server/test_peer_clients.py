"""SGLang's own benchmark client (`python -m sglang.bench_serving`, installed by `make test` without its GPU
dependencies) against `tessera serve`: its native backend (/generate) and its OpenAI chat backend, each with an
image per request, every request answered. Its warm-up was refused before (`"lora_path": null`)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

from tessera.config import ASSETS_DIR

# Found, not imported: importing sglang registers its own transformers configs (its Qwen3-ASR one reads the original
# `thinker_config` layout), which would change how every later test in this process reads such a checkpoint.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                reason="installed by `make test` (the Makefile's PEER_CLIENT)")


@pytest.mark.slow  # two benchmark runs: ~20 s
@pytest.mark.parametrize("backend", ["sglang", "sglang-oai-chat"])
def test_sglang_bench_serving_with_images(vl_server, tmp_path, backend) -> None:
    # The client loads the model's processor by the served name: a folder of that name in its working directory
    # (it would otherwise look the name up on the Hub).
    (tmp_path / "demo-vl").symlink_to(ASSETS_DIR / "demo-vl")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "sglang.bench_serving", "--backend", backend, "--host", "127.0.0.1",
         "--port", str(vl_server.port), "--dataset-name", "image", "--num-prompts", "8", "--image-count", "1",
         "--image-resolution", "448x448", "--random-input-len", "32", "--random-output-len", "8",
         "--tokenizer", "demo-vl", "--model", "demo-vl", "--disable-tqdm"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    done = re.search(r"Successful requests:\s+(\d+)", out.stdout)
    assert done and int(done.group(1)) == 8, out.stdout[-3000:]
