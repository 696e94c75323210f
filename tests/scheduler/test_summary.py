"""The scheduler's periodic one-line summary."""

from __future__ import annotations

import logging

from tessera import messages
from tessera.scheduler.summary import PeriodicSummary


def stats(prefill: int) -> messages.SchedulerStats:
    import dataclasses

    required = {f.name: 0 for f in dataclasses.fields(messages.SchedulerStats)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return messages.SchedulerStats(**{**required, "num_running": 3, "num_waiting": 2, "kv_used_tokens": 512,
                                "kv_total_tokens": 2048, "radix_cache_tokens": 100,
                                "num_prefill_tokens_computed": prefill})


def test_one_line_while_busy_and_silence_when_idle(caplog, monkeypatch):
    now = [100.0]
    monkeypatch.setattr("tessera.scheduler.summary.time.monotonic", lambda: now[0])
    summary = PeriodicSummary(interval=10.0)
    with caplog.at_level(logging.INFO, logger="tessera.scheduler"):
        summary.tick(lambda: stats(0), 0, busy=True)
        now[0] = 105.0
        summary.tick(lambda: stats(500), 50, busy=True)  # not yet due
        assert not caplog.records
        now[0] = 110.0
        summary.tick(lambda: stats(1000), 200, busy=True)
        (line,) = [r.getMessage() for r in caplog.records]
        assert line == ("running 3, queued 2, KV 512/2048 tokens (25.0%), cached prefix 100 tokens, "
                        "prefill 100.0 tok/s, output 20.0 tok/s")
        now[0] = 125.0
        summary.tick(lambda: stats(1000), 200, busy=False)  # the last interval had work: one more line
        now[0] = 140.0
        summary.tick(lambda: stats(1000), 200, busy=False)  # idle throughout: nothing
    assert len(caplog.records) == 2
