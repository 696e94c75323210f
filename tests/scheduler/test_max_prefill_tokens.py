"""--max-prefill-tokens (SGLang's: prompt tokens admitted per step, across requests) in the real scheduler over
demo-vl's worker: with a small limit the prompts that arrive together are spread over more steps, no step
takes more than the limit unless one prompt alone is longer, and every request's tokens are the same."""

from __future__ import annotations

from tessera.scheduler.policy import SchedulePolicy
from tests.scheduler.test_overlap import _req, _run, demo  # noqa: F401 -- demo: the module's fixture


def test_max_prefill_tokens_spreads_admissions_and_keeps_the_tokens(demo, monkeypatch):  # noqa: F811
    prefill_steps: list[int] = []
    next_batch = SchedulePolicy.next_batch

    def recorded(self):
        batch = next_batch(self)
        if batch is not None and batch.num_prefill_tokens:
            prefill_steps.append(batch.num_prefill_tokens)
        return batch

    monkeypatch.setattr(SchedulePolicy, "next_batch", recorded)
    arrivals = {0: [_req(demo, i, max_new_tokens=6) for i in range(6)]}
    plain, _, _ = _run(demo, False, arrivals)
    unlimited, prefill_steps[:] = list(prefill_steps), []
    limit = 2 * min(len(p) for p in demo[4][:6]) + 1  # two prompts at most a step
    limited, stats, _ = _run((demo[0].replace(max_prefill_tokens=limit), *demo[1:]), False, arrivals)
    assert len(unlimited) == 1 and unlimited[0] == sum(len(p) for p in demo[4][:6])
    assert len(prefill_steps) >= 3 and all(n <= limit for n in prefill_steps)
    assert {rid: r["ids"] for rid, r in limited.items()} == {rid: r["ids"] for rid, r in plain.items()}
    assert stats.kv_used_tokens == 0 and stats.num_waiting == 0
