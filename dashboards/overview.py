"""The Overview dashboard: traffic, sparsity, gate confidence, drift, trust actions, alerts
and latency of the selected models and levels."""

from __future__ import annotations

from dashboards.model import Dashboard, Panel, Row, Target
from dashboards.promql import KEY, quantiles, rate, select, window
from services.config import SignalSettings, TrustSettings

PER_KEY = "{{model}} {{level}}"
CACHE_HIT_HEALTHY = 0.85  # drawn green from here: a warm prefix cache (no alert reads it)


def overview(
    signals: SignalSettings | None = None, trust: TrustSettings | None = None
) -> Dashboard:
    """The dashboard with `signals`' thresholds and `trust`'s flag budget (default: the
    published ones)."""
    signals = signals or SignalSettings()
    trust = trust or TrustSettings()
    low, high = signals.gate_band
    monotonous = signals.monotonous_confidence
    return Dashboard(
        uid="sparseguard-overview",
        title="SparseGuard / Overview",
        description="Health of sparse inference at a glance; details on the Silence, Pipeline "
        "and Jobs dashboards.",
        items=(
            Row("Traffic"),
            Panel(
                "Request rate by level and status",
                (
                    Target(
                        rate(
                            "sparseguard_gateway_requests_total", "level, status", 'level=~"$level"'
                        ),
                        "{{level}} {{status}}",
                    ),
                ),
                description="Gateway requests (all models: the gateway serves one).",
                unit="reqps",
            ),
            Panel(
                "Error ratio (5m window)",
                (Target(window("sparseguard_window_error_ratio"), PER_KEY),),
                unit="percentunit",
                min=0,
            ),
            Row("Sparsity and gate"),
            Panel(
                "Sparsity vs calibrated target (5m window)",
                (
                    Target(window("sparseguard_window_sparsity_ratio"), f"{PER_KEY} realised"),
                    Target(window("sparseguard_window_sparsity_target_ratio"), f"{PER_KEY} target"),
                ),
                description="Realised sparsity should stay at or above the calibration's target.",
                unit="percentunit",
                min=0,
                max=1,
            ),
            Panel(
                f"Gate confidence (healthy band {low:g}-{high:g})",
                (Target(window("sparseguard_window_gate_confidence_ratio"), PER_KEY),),
                description=f"Share of activation magnitude kept. Below {low:g} the sparsifier "
                f"drops too much; above {monotonous:g} the input is likely templated.",
                unit="percentunit",
                min=0.5,
                max=1,
                base_color="red",
                steps=((low, "green"), (high, "orange"), (monotonous, "red")),
                show_thresholds="line+area",
            ),
            Panel(
                "Per-layer sparsity shift (5m window)",
                (Target(window("sparseguard_window_layer_sparsity_shift"), PER_KEY),),
                description="The most shifted layer's mean sparsity, in standard errors beyond "
                f"its healthy tolerance; above {signals.alert_z:g} for 5 minutes alerts "
                "(LayerSparsityShift): part of the model computes unlike when calibrated.",
                steps=((signals.alert_z, "red"),),
                show_thresholds="line",
            ),
            Panel(
                "Request spread vs healthy traffic (5m window)",
                (Target(window("sparseguard_window_signal_spread_ratio"), PER_KEY),),
                description="How much the requests' signals vary, as a share of healthy "
                f"traffic's spread (an upper bound); under {signals.spread_floor:g} for 5 "
                "minutes alerts (SignalSpreadCollapsed): one input sent over and over.",
                min=0,
                base_color="red",
                steps=((signals.spread_floor, "green"),),
                show_thresholds="line",
            ),
            Panel(
                "Late-band silence vs healthy baseline (5m window)",
                (
                    Target(window("sparseguard_window_late_silence_ratio"), PER_KEY),
                    Target(
                        select("sparseguard_baseline_center", f'{KEY}, signal="late_silence"'),
                        f"{PER_KEY} baseline",
                    ),
                ),
                description="Mean silence of the last layers and what the calibration measured "
                "on healthy traffic; significantly above it alerts (LateSilenceHigh).",
                unit="percentunit",
                min=0,
                max=1,
            ),
            Panel(
                "Semantic drift KL(dense || sparse)",
                (
                    Target(window("sparseguard_window_semantic_drift_kl"), f"{PER_KEY} 5m"),
                    Target(window("sparseguard_window_semantic_drift_kl", "24h"), f"{PER_KEY} 24h"),
                ),
                description="Mean token-level KL on the sampled requests; a 24 h mean above "
                f"{signals.drift_kl_24h:g} alerts and queues a recalibration.",
                steps=((signals.drift_kl_24h, "red"),),
                show_thresholds="line",
                min=0,
            ),
            Panel(
                "Prefix cache hit rate (5m window)",
                (Target(window("sparseguard_window_cache_hit_ratio"), PER_KEY),),
                unit="percentunit",
                min=0,
                max=1,
                base_color="red",
                steps=((signals.cache_hit_min, "orange"), (CACHE_HIT_HEALTHY, "green")),
                show_thresholds="line",
            ),
            Panel(
                "Trust actions",
                (
                    Target(
                        rate("sparseguard_trust_actions_total", "model, level, action"),
                        f"{{{{action}}}} {PER_KEY}",
                    ),
                ),
                description="Requests the gateway answered with a trust action (e.g. fallback).",
                unit="reqps",
            ),
            Panel(
                "Trust action rate",
                (
                    Target(
                        "sum by (model, level) (rate(sparseguard_trust_actions_total{"
                        'action!="none", level=~"$level"}[$__rate_interval])) / sum by (model, '
                        'level) (rate(sparseguard_trust_actions_total{level=~"$level"}'
                        "[$__rate_interval]))",
                        PER_KEY,
                    ),
                ),
                description="Share of answers with a trust action (flag, retrieve, simplify); the "
                f"line is the flag budget ({trust.flag_budget:g}): the share of healthy answers "
                "each level's threshold may flag.",
                unit="percentunit",
                min=0,
                steps=((trust.flag_budget, "red"),),
                show_thresholds="line",
            ),
            Panel(
                "Trust score distribution (gateway)",
                tuple(
                    Target(
                        f"histogram_quantile({q}, sum by (le, level) (rate("
                        f'sparseguard_gateway_trust_score_bucket{{level=~"$level"}}[$__rate_interval])))',
                        f"p{round(q * 100)} {{{{level}}}}",
                    )
                    for q in (0.05, 0.25, 0.5, 0.75, 0.95)
                ),
                description="Trust of each answer before any action: the trust model's probability "
                "that it is right (1 - late-layer silence without a model).",
                min=0,
                max=1,
            ),
            Row("Alerts"),
            Panel(
                "Firing alerts",
                (Target('count(ALERTS{alertstate="firing"}) or vector(0)', "firing"),),
                kind="stat",
                width=6,
                steps=((1, "red"),),
            ),
            Panel(
                "Alert transitions",
                (
                    Target(
                        "sum by (alertname, state) "
                        "(increase(sparseguard_alert_transitions_total[$__rate_interval]))",
                        "{{alertname}} {{state}}",
                    ),
                ),
                description="State changes from the aggregator's own evaluator.",
                width=18,
            ),
            Row("Latency"),
            Panel(
                "Request latency",
                quantiles("sparseguard_request_latency_seconds"),
                unit="s",
            ),
            Panel(
                "Time to first token",
                quantiles("sparseguard_request_ttft_seconds"),
                unit="s",
            ),
            Row("Engine batching"),
            Panel(
                "Queue time",
                quantiles("sparseguard_gateway_queue_wait_seconds", ""),
                description="Wait from admission to the start of the request's prefill.",
                unit="s",
            ),
            Panel(
                "Batch size",
                (
                    *quantiles("sparseguard_engine_batch_size", ""),
                    Target("sum(sparseguard_engine_running_sequences)", "running now"),
                ),
                description="Mean sequences per decode step over each request (continuous "
                "batching), and the sequences decoding at the last scrape.",
            ),
        ),
    )
