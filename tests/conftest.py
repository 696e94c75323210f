"""Fixtures shared across test folders."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def demo_vl_engine():
    """One offline Engine on the bundled demo-vl for the structured-output and tessera.lang tests. Small
    prefill chunks and KV pool on purpose: an image prompt is prefilled in several chunks, and a handful of
    concurrent requests runs the pool dry, so requests are retracted and resumed."""
    from tessera import Engine

    with Engine("demo-vl", max_total_tokens=384, chunked_prefill_size=48, max_running_requests=16,
                show_progress=False) as engine:
        yield engine
