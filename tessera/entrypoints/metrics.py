"""Prometheus metrics of the server: request counts, latency histograms, scheduler gauges."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tessera.frontend.result import GenerateResult

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
# Gauges that show one SchedulerStats field as it is: (metric, help, field). The leak checks read the
# tessera_kv_used_tokens / radix / encoder-cache ones: after a drain they return to their idle values (0 for the
# KV; the caches hold what they cached, within their configured sizes).
_STAT_GAUGES = (
    ("tessera_num_running_reqs", "Requests running in the scheduler", "num_running"),
    ("tessera_num_queue_reqs", "Requests waiting in the scheduler", "num_waiting"),
    ("tessera_kv_used_tokens", "KV slots held by requests (not the prefix cache)", "kv_used_tokens"),
    ("tessera_cross_attention_kv_used_tokens", "KV slots held by encoder-decoder requests' cross-attention K/V "
     "(part of tessera_kv_used_tokens)", "cross_kv_used_tokens"),
    ("tessera_radix_cache_tokens", "Tokens held by the prefix cache", "radix_cache_tokens"),
    ("tessera_encoder_cache_bytes", "Bytes held by the encoder-output cache", "encoder_cache_bytes"),
    ("tessera_encoder_cache_hits", "Encoder-cache hits", "encoder_cache_hits"),
    ("tessera_encoder_cache_misses", "Encoder-cache misses", "encoder_cache_misses"),
    ("tessera_device_busy_seconds", "Seconds the device computed model steps", "device_busy_s"),
    ("tessera_device_idle_between_steps_seconds", "Seconds the device sat idle between consecutive model steps "
     "while there was work (the scheduler's host work)", "device_idle_s"),
    ("tessera_device_idle_fraction", "Idle between steps / (idle + busy)", "device_idle_fraction"),
    ("tessera_spec_accept_length", "Speculative decoding: tokens emitted per verify step (accepted drafts + 1)",
     "spec_accept_length"),
    ("tessera_spec_accept_rate", "Speculative decoding: accepted drafts / drafts", "spec_accept_rate"),
    ("tessera_spec_verify_steps", "Speculative decoding: request-steps that verified drafts", "spec_verifies"),
    ("tessera_embedding_requests", "Embedding requests answered (prefill only, pooled)", "num_embedding_requests"),
)


class Metrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model_name = model_name
        self.requests = Counter("tessera_requests", "Finished requests", ["model_name", "endpoint", "status"], registry=r)
        self.rejected = Counter("tessera_rejected_requests", "Requests refused with 503 because more generations "
                                "than --max-queued-requests were waiting", labels, registry=r)
        self.prompt_tokens = Counter("tessera_prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter("tessera_generation_tokens", "Tokens generated", labels, registry=r)
        self.cached_tokens = Counter("tessera_cached_prompt_tokens", "Prompt tokens served from the prefix cache",
                                     labels, registry=r)
        self.ttft = Histogram("tessera_time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tessera_inter_token_latency_seconds", "Time between output tokens", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tessera_e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_usage = Gauge("tessera_kv_cache_usage", "Fraction of KV slots held by requests", labels, registry=r)
        self.prefix_hit_rate = Gauge("tessera_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache",
                                     labels, registry=r)
        self.encoder_hit_rate = Gauge("tessera_encoder_cache_hit_rate", "Encoder-cache hits / lookups", labels,
                                      registry=r)
        self.stat_gauges = {field: Gauge(name, doc, labels, registry=r) for name, doc, field in _STAT_GAUGES}
        # Leak check: after a drain it returns to 0, as tessera_kv_used_tokens does.
        self.frontend_reqs = Gauge("tessera_num_frontend_reqs", "Requests the frontend is tracking (sent to the "
                                   "scheduler, not yet finished)", labels, registry=r)
        self.preprocess_cache_bytes = Gauge("tessera_preprocess_cache_bytes", "Bytes held by the preprocessing "
                                            "cache", labels, registry=r)
        per_replica = ["model_name", "dp_rank"]
        self.replica_running = Gauge("tessera_replica_num_running_reqs", "Requests running, per data-parallel "
                                     "replica", per_replica, registry=r)
        self.replica_queued = Gauge("tessera_replica_num_queue_reqs", "Requests waiting, per data-parallel replica",
                                    per_replica, registry=r)
        self.replica_kv_usage = Gauge("tessera_replica_kv_cache_usage", "Fraction of KV slots held by requests, "
                                      "per data-parallel replica", per_replica, registry=r)
        self.mm_transport_bytes = Gauge("tessera_mm_transport_bytes", "Media payload bytes sent from the frontend "
                                        "to the scheduler", ["model_name", "modality"], registry=r)
        self.mm_items = Gauge("tessera_mm_items", "Media items received by the scheduler, by how they were "
                              "preprocessed (deferred: raw pixels, preprocessed by the encoder's worker)",
                              ["model_name", "preprocessing"], registry=r)
        self.preprocess_hit_rate = Gauge("tessera_preprocess_cache_hit_rate",
                                         "Media items served from the preprocessing cache / items", labels, registry=r)

    def observe_request(self, state, result: GenerateResult) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(result.prompt_tokens)
        self.generation_tokens.labels(m).inc(result.completion_tokens)
        self.cached_tokens.labels(m).inc(result.cached_tokens)
        if result.ttft is not None:
            self.ttft.labels(m).observe(result.ttft)
        self.e2e.labels(m).observe(result.e2e_latency)
        times = state.token_times
        for a, b in zip(times, times[1:]):
            if b > a:
                self.itl.labels(m).observe(b - a)

    def render(self, stats, frontend=None, replicas=(), frontend_requests: int | None = None) -> bytes:
        m = self.model_name
        if frontend_requests is not None:
            self.frontend_reqs.labels(m).set(frontend_requests)
        for rs in replicas:
            dp = str(rs.dp_rank)
            self.replica_running.labels(m, dp).set(rs.num_running)
            self.replica_queued.labels(m, dp).set(rs.num_waiting)
            self.replica_kv_usage.labels(m, dp).set(rs.kv_used_tokens / max(1, rs.kv_total_tokens))
        if frontend is not None:
            items = frontend.preprocess_cache_hits + frontend.preprocess_cache_misses
            self.preprocess_hit_rate.labels(m).set(frontend.preprocess_cache_hits / max(1, items))
            self.preprocess_cache_bytes.labels(m).set(frontend.preprocess_cache_bytes)
        if stats is not None:
            for field, gauge in self.stat_gauges.items():
                gauge.labels(m).set(getattr(stats, field))
            self.kv_usage.labels(m).set(stats.kv_used_tokens / max(1, stats.kv_total_tokens))
            self.prefix_hit_rate.labels(m).set(stats.prefix_hit_tokens / max(1, stats.prefix_total_tokens))
            lookups = stats.encoder_cache_hits + stats.encoder_cache_misses
            self.encoder_hit_rate.labels(m).set(stats.encoder_cache_hits / max(1, lookups))
            for modality, n in stats.mm_transport_bytes.items():
                self.mm_transport_bytes.labels(m, modality).set(n)
            self.mm_items.labels(m, "deferred").set(stats.mm_deferred_items)
            self.mm_items.labels(m, "eager").set(stats.mm_eager_items)
        return generate_latest(self.registry)
