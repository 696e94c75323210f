"""Prometheus metrics of the server: request counts, latency histograms, scheduler gauges."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tessera.frontend.result import GenerateResult

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


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
        self.running = Gauge("tessera_num_running_reqs", "Requests running in the scheduler", labels, registry=r)
        self.queued = Gauge("tessera_num_queue_reqs", "Requests waiting in the scheduler", labels, registry=r)
        self.kv_usage = Gauge("tessera_kv_cache_usage", "Fraction of KV slots held by requests", labels, registry=r)
        self.cross_kv_used = Gauge("tessera_cross_attention_kv_used_tokens", "KV slots held by encoder-decoder "
                                   "requests' cross-attention K/V (part of tessera_kv_used_tokens)", labels, registry=r)
        self.prefix_hit_rate = Gauge("tessera_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache",
                                     labels, registry=r)
        self.encoder_hit_rate = Gauge("tessera_encoder_cache_hit_rate", "Encoder-cache hits / lookups", labels,
                                      registry=r)
        self.encoder_hits = Gauge("tessera_encoder_cache_hits", "Encoder-cache hits", labels, registry=r)
        self.encoder_misses = Gauge("tessera_encoder_cache_misses", "Encoder-cache misses", labels, registry=r)
        # Leak checks: after a drain these return to their idle values (0 for the first two; the caches hold
        # what they cached, within their configured sizes).
        self.frontend_reqs = Gauge("tessera_num_frontend_reqs", "Requests the frontend is tracking (sent to the "
                                   "scheduler, not yet finished)", labels, registry=r)
        self.kv_used_tokens = Gauge("tessera_kv_used_tokens", "KV slots held by requests (not the prefix cache)",
                                    labels, registry=r)
        self.radix_cache_tokens = Gauge("tessera_radix_cache_tokens", "Tokens held by the prefix cache", labels,
                                        registry=r)
        self.encoder_cache_bytes = Gauge("tessera_encoder_cache_bytes", "Bytes held by the encoder-output cache",
                                         labels, registry=r)
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
        self.device_busy = Gauge("tessera_device_busy_seconds", "Seconds the device computed model steps",
                                 labels, registry=r)
        self.device_idle = Gauge("tessera_device_idle_between_steps_seconds", "Seconds the device sat idle between "
                                 "consecutive model steps while there was work (the scheduler's host work)",
                                 labels, registry=r)
        self.device_idle_fraction = Gauge("tessera_device_idle_fraction", "Idle between steps / (idle + busy)",
                                          labels, registry=r)
        self.spec_accept_length = Gauge("tessera_spec_accept_length", "Speculative decoding: tokens emitted per "
                                        "verify step (accepted drafts + 1)", labels, registry=r)
        self.spec_accept_rate = Gauge("tessera_spec_accept_rate", "Speculative decoding: accepted drafts / drafts",
                                      labels, registry=r)
        self.spec_verifies = Gauge("tessera_spec_verify_steps", "Speculative decoding: request-steps that verified "
                                   "drafts", labels, registry=r)
        self.embedding_requests = Gauge("tessera_embedding_requests", "Embedding requests answered (prefill only, "
                                        "pooled)", labels, registry=r)
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
            self.running.labels(m).set(stats.num_running)
            self.queued.labels(m).set(stats.num_waiting)
            self.kv_usage.labels(m).set(stats.kv_used_tokens / max(1, stats.kv_total_tokens))
            self.kv_used_tokens.labels(m).set(stats.kv_used_tokens)
            self.radix_cache_tokens.labels(m).set(stats.radix_cache_tokens)
            self.encoder_cache_bytes.labels(m).set(stats.encoder_cache_bytes)
            self.cross_kv_used.labels(m).set(stats.cross_kv_used_tokens)
            self.prefix_hit_rate.labels(m).set(stats.prefix_hit_tokens / max(1, stats.prefix_total_tokens))
            lookups = stats.encoder_cache_hits + stats.encoder_cache_misses
            self.encoder_hit_rate.labels(m).set(stats.encoder_cache_hits / max(1, lookups))
            self.encoder_hits.labels(m).set(stats.encoder_cache_hits)
            self.encoder_misses.labels(m).set(stats.encoder_cache_misses)
            for modality, n in stats.mm_transport_bytes.items():
                self.mm_transport_bytes.labels(m, modality).set(n)
            self.mm_items.labels(m, "deferred").set(stats.mm_deferred_items)
            self.mm_items.labels(m, "eager").set(stats.mm_eager_items)
            self.device_busy.labels(m).set(stats.device_busy_s)
            self.device_idle.labels(m).set(stats.device_idle_s)
            self.device_idle_fraction.labels(m).set(stats.device_idle_fraction)
            self.spec_accept_length.labels(m).set(stats.spec_accept_length)
            self.spec_accept_rate.labels(m).set(stats.spec_accept_rate)
            self.spec_verifies.labels(m).set(stats.spec_verifies)
            self.embedding_requests.labels(m).set(stats.num_embedding_requests)
        return generate_latest(self.registry)
