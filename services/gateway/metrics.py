"""The gateway's own metrics (per request, per process); the rolling health windows are the
aggregator's."""

from __future__ import annotations

from typing import cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.shared.metrics_table import MetricSpec, declare

LATENCY = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
BATCH = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0, 64.0)
RATIO = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

GATEWAY_METRICS = (
    MetricSpec(
        "gateway_requests_total",
        Counter,
        "Chat requests by outcome",
        ("api", "mode", "level", "status"),
    ),
    MetricSpec(
        "gateway_request_duration_seconds", Histogram, "Request latency", ("api", "mode"), LATENCY
    ),
    MetricSpec(
        "gateway_time_to_first_token_seconds", Histogram, "Time to first token", ("mode",), LATENCY
    ),
    MetricSpec("gateway_queue_wait_seconds", Histogram, "Wait for the engine worker", (), LATENCY),
    MetricSpec(
        "engine_batch_size",
        Histogram,
        "Mean sequences per decode step, per request (continuous batching)",
        (),
        BATCH,
    ),
    MetricSpec("engine_running_sequences", Gauge, "Sequences decoding in the running batch"),
    MetricSpec(
        "gateway_request_sparsity_ratio", Histogram, "Per-request sparsity", ("level",), RATIO
    ),
    MetricSpec("gateway_tokens_total", Counter, "Tokens processed", ("kind",)),
    MetricSpec(
        "gateway_prefix_cache_tokens_total",
        Counter,
        "Prompt tokens by prefix cache result",
        ("result",),
    ),
    MetricSpec(
        "gateway_prefix_cache_mismatches_total",
        Counter,
        "Prefixes refused: other calibration or level",
    ),
    MetricSpec(
        "gateway_trust_score",
        Histogram,
        "Trust score of each answer (the first one, when an action regenerated it)",
        ("level",),
        RATIO,
    ),
    MetricSpec(
        "gateway_trust_actions_total",
        Counter,
        "Trust decisions by action taken: none, flag, retrieve, simplify",
        ("action", "route"),
    ),
    MetricSpec(
        "gateway_trust_reasons_total",
        Counter,
        "Reasons that lowered trust: silence-spike, gate-degraded, monotonous-input, low-score",
        ("reason",),
    ),
    MetricSpec("gateway_queue_rejections_total", Counter, "Requests refused with 429"),
    MetricSpec("gateway_policy_changes_total", Counter, "Policy changes applied", ("kind",)),
    MetricSpec(
        "calibration_reloads_total",
        Counter,
        "Calibration versions installed without a restart",
        ("level",),
    ),
    MetricSpec("gateway_queue_depth", Gauge, "Requests waiting for the engine"),
    MetricSpec("telemetry_spool_bytes", Gauge, "Bytes of telemetry waiting in the local spool"),
    MetricSpec(
        "telemetry_events_dropped", Gauge, "Telemetry events dropped since start (spool full)"
    ),
)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        m = declare(registry, GATEWAY_METRICS)
        self.requests = cast(Counter, m["gateway_requests_total"])
        self.duration = cast(Histogram, m["gateway_request_duration_seconds"])
        self.ttft = cast(Histogram, m["gateway_time_to_first_token_seconds"])
        self.queue_wait = cast(Histogram, m["gateway_queue_wait_seconds"])
        self.batch_size = cast(Histogram, m["engine_batch_size"])
        self.running = cast(Gauge, m["engine_running_sequences"])
        self.sparsity = cast(Histogram, m["gateway_request_sparsity_ratio"])
        self.tokens = cast(Counter, m["gateway_tokens_total"])
        self.cache_tokens = cast(Counter, m["gateway_prefix_cache_tokens_total"])
        self.cache_mismatches = cast(Counter, m["gateway_prefix_cache_mismatches_total"])
        self.trust_score = cast(Histogram, m["gateway_trust_score"])
        self.trust_actions = cast(Counter, m["gateway_trust_actions_total"])
        self.trust_reasons = cast(Counter, m["gateway_trust_reasons_total"])
        self.rejections = cast(Counter, m["gateway_queue_rejections_total"])
        self.policy_changes = cast(Counter, m["gateway_policy_changes_total"])
        self.calibration_reloads = cast(Counter, m["calibration_reloads_total"])
        self.queue_depth = cast(Gauge, m["gateway_queue_depth"])
        self.spool_bytes = cast(Gauge, m["telemetry_spool_bytes"])
        self.dropped = cast(Gauge, m["telemetry_events_dropped"])
