"""The memory floor of a batch-1 decode step: the language model's weight bytes over the machine's copy bandwidth.

At batch 1 a decode step reads every weight of the language model once and does little arithmetic per byte,
so no implementation can step faster than the time it takes to stream those bytes from memory. Two
bandwidths are measured on a buffer far larger than the caches: what `dst.copy_(src)` moves per second (bytes
copied, counted once, as the issue's floor is defined) and what `src.sum()` reads per second (a decode
step only reads its weights; a copy also writes, so it measured 2-4x lower here). The floor uses the higher
of the two, so it is the stricter one; the copy-bandwidth floor (the issue's wording) is reported next to it.
Counted: every checkpoint tensor of the language model at the run's dtype; not counted: the media towers (not
run while decoding) and the input embedding table (one row read per token) unless it doubles as the LM head.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

_TOWER_PREFIXES = ("visual.", "model.visual.", "vision_tower.", "model.vision_tower.", "audio_tower.",
                   "model.audio_tower.", "multi_modal_projector.", "model.multi_modal_projector.")


def decode_weight_bytes(model_path: str, dtype: torch.dtype = torch.float32) -> int:
    """Bytes of the language model's weights a batch-1 decode step reads (see the module docstring)."""
    from safetensors import safe_open

    path = Path(model_path)
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config") or config
    tied = bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 -- safe_open is not a mapping
                if name.startswith(_TOWER_PREFIXES) or (name.endswith("embed_tokens.weight") and not tied):
                    continue
                numel = 1
                for d in f.get_slice(name).get_shape():
                    numel *= d
                total += numel * dtype.itemsize
    return total


def bandwidths(num_bytes: int = 256 * 2**20, repeats: int = 5) -> tuple[float, float]:
    """(copy, read) bytes per second, medians of `repeats`, with this process's torch threads."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch: page faults stay out of the timing

    def median_seconds(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return num_bytes / median_seconds(lambda: dst.copy_(src)), num_bytes / median_seconds(src.sum)


def memory_floor(model_path: str, dtype: torch.dtype = torch.float32) -> dict:
    weights = decode_weight_bytes(model_path, dtype)
    copy, read = bandwidths()
    return {"weight_bytes": weights, "copy_bandwidth_gb_s": copy / 1e9, "read_bandwidth_gb_s": read / 1e9,
            "floor_ms": weights / max(copy, read) * 1e3, "copy_floor_ms": weights / copy * 1e3}
