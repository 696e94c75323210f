"""tessera.bench.structured on the shared demo-vl Engine: every arm decodes exactly the asked tokens."""

from __future__ import annotations

from tessera.bench.structured import ARMS, measure


def test_each_arm_decodes_the_same_number_of_steps(demo_vl_engine):
    result = measure(demo_vl_engine, batch_size=2, tokens=6, repeats=1)  # measure asserts the token counts
    assert set(result) == set(ARMS) and all(ms > 0 for ms in result.values())
