"""The Pipeline dashboard: the telemetry path from the gateways' spools through the broker to
the aggregator, and the alert webhooks out of it."""

from __future__ import annotations

from dashboards.model import Dashboard, Panel, Row, Target
from dashboards.promql import quantiles, rate

PIPELINE = Dashboard(
    uid="sparseguard-pipeline",
    title="SparseGuard / Pipeline",
    description="Telemetry delivery, aggregation and webhook delivery.",
    items=(
        Row("Gateways"),
        Panel(
            "Telemetry spool size",
            (Target("sparseguard_telemetry_spool_bytes", "{{instance}}"),),
            description="Telemetry waiting in a gateway's local spool: the broker is "
            "unreachable or slow while it grows.",
            unit="bytes",
            min=0,
        ),
        Panel(
            "Telemetry events dropped (spool full)",
            (Target("sparseguard_telemetry_events_dropped", "{{instance}}"),),
            min=0,
        ),
        Panel(
            "Engine queue",
            (
                Target("sum(sparseguard_gateway_queue_depth)", "waiting"),
                Target(rate("sparseguard_gateway_queue_rejections_total", "", ""), "rejected/s"),
            ),
            width=24,
        ),
        Row("Aggregator"),
        Panel(
            "Consumer lag by partition",
            (
                Target(
                    "max by (partition) (sparseguard_aggregator_consumer_lag_events)",
                    "{{partition}}",
                ),
            ),
            description="Events behind the log end; above 1000 the TelemetryPipelineLag alert "
            "fires and the windows are stale.",
            min=0,
            steps=((1000, "red"),),
            show_thresholds="line",
        ),
        Panel(
            "Events folded",
            (Target(rate("sparseguard_events_total", "status"), "{{status}}"),),
            unit="ops",
        ),
        Panel(
            "Dead letters, duplicates and late events",
            (
                Target(rate("sparseguard_events_dead_lettered_total", "", ""), "dead-lettered"),
                Target(rate("sparseguard_events_duplicate_total", "", ""), "duplicate"),
                Target(rate("sparseguard_events_late_total", "", ""), "late"),
            ),
            unit="ops",
        ),
        Panel(
            "Batch time (poll to commit)",
            quantiles("sparseguard_aggregator_batch_seconds", ""),
            unit="s",
        ),
        Panel(
            "Event time to fold",
            quantiles("sparseguard_aggregator_event_to_fold_seconds", ""),
            unit="s",
            width=24,
        ),
        Row("Webhooks"),
        Panel(
            "Webhook deliveries",
            (
                Target(
                    rate("sparseguard_webhook_deliveries_total", "receiver, outcome", ""),
                    "{{receiver}} {{outcome}}",
                ),
            ),
            unit="ops",
        ),
        Panel(
            "Webhook outbox pending",
            (Target("max(sparseguard_webhook_outbox_pending)", "pending"),),
            min=0,
        ),
    ),
)
