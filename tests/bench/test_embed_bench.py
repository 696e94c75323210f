"""`tessera bench embed` measures the same work on both sides: Tessera's vectors equal transformers' for the
benchmark's inputs (a few, on demo-vl), and the result reports every rate."""

from __future__ import annotations

import pytest

from tessera.bench.cli import build_parser
from tessera.bench.embed import run_embed_bench


@pytest.mark.slow  # an Engine and transformers on demo-vl: ~15 s
def test_embed_bench_compares_equal_vectors() -> None:
    result = run_embed_bench("demo-vl", num_texts=6, num_images=2, hf_batch_size=4)
    assert result.min_cosine >= 0.99999
    rates = [v for k, v in result.as_dict().items() if k.endswith("_per_s")]
    assert len(rates) == 6 and all(r > 0 for r in rates)
    assert "texts" in result.summary() and "images" in result.summary()
    ns = build_parser().parse_args(["embed", "--num-texts", "3"])
    assert (ns.num_texts, ns.num_images, ns.hf_batch_size) == (3, 64, 32)
