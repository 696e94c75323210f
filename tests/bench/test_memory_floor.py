"""The batch-1 memory floor counts the language model's weights only, at the run's dtype."""

from __future__ import annotations

import pytest
import torch

from tessera.bench.memory_floor import decode_weight_bytes, memory_floor
from tessera.models.registry import load_model


def test_weight_bytes_are_the_language_models_minus_the_input_embedding() -> None:
    from tessera.bench.medium import resolve_bench_model

    path = resolve_bench_model("demo-vl", 0)
    model, config = load_model(path, language_model_only=True)
    params = dict(model.named_parameters())
    want = sum(p.numel() for n, p in params.items() if "embed_tokens" not in n or config.tie_word_embeddings) * 4
    assert decode_weight_bytes(path) == want
    assert decode_weight_bytes(path, torch.bfloat16) == want // 2
    floor = memory_floor(path)
    assert floor["read_bandwidth_gb_s"] > 0 and floor["copy_bandwidth_gb_s"] > 0
    best = max(floor["read_bandwidth_gb_s"], floor["copy_bandwidth_gb_s"]) * 1e9
    assert floor["floor_ms"] == pytest.approx(want / best * 1e3)
