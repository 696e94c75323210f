"""The scheduler's periodic one-line summary (as SGLang's "Decode batch" line): running and queued requests,
KV usage, and the token rates since the last line. Printed at most every `interval` seconds, and only while
there is work, so an idle server stays quiet."""

from __future__ import annotations

import logging
import time

from tessera import messages

logger = logging.getLogger("tessera.scheduler")
INTERVAL_S = 10.0


class PeriodicSummary:
    def __init__(self, interval: float = INTERVAL_S, dp_rank: int = 0) -> None:
        self.interval, self.dp_rank = interval, dp_rank
        self._last = time.monotonic()
        self._last_prefill = self._last_output = 0
        self._active = False  # anything ran since the last line

    def tick(self, stats_fn, num_output_tokens: int, busy: bool) -> None:
        """Call once per loop turn; `stats_fn()` is only evaluated when a line is due."""
        self._active |= busy
        now = time.monotonic()
        if now - self._last < self.interval or not logger.isEnabledFor(logging.INFO):
            return
        if self._active:
            s: messages.SchedulerStats = stats_fn()
            dt = now - self._last
            prefill = (s.num_prefill_tokens_computed - self._last_prefill) / dt
            output = (num_output_tokens - self._last_output) / dt
            replica = f"[dp {self.dp_rank}] " if self.dp_rank else ""
            logger.info("%srunning %d, queued %d, KV %d/%d tokens (%.1f%%), cached prefix %d tokens, "
                        "prefill %.1f tok/s, output %.1f tok/s", replica, s.num_running, s.num_waiting,
                        s.kv_used_tokens, s.kv_total_tokens, 100.0 * s.kv_used_tokens / max(1, s.kv_total_tokens),
                        s.radix_cache_tokens, prefill, output)
            self._last_prefill, self._last_output = s.num_prefill_tokens_computed, num_output_tokens
        self._last, self._active = now, busy
