"""The Silence dashboard: the per-layer silence rate over time (one row per layer, coloured by
rate) and the late-layer silence spikes that mark low-trust requests."""

from __future__ import annotations

from dashboards.model import Dashboard, Panel, Target
from dashboards.promql import rate, window
from services.config import SignalSettings

RATE = "sparseguard_window_silence_rate_ratio"


def per_layer(name: str) -> Target:
    return Target(f"avg by (layer) ({window(RATE, name)})", "layer {{layer}}")


def silence(signals: SignalSettings | None = None) -> Dashboard:
    """The dashboard with `signals`' thresholds (default: the published ones)."""
    signals = signals or SignalSettings()
    return Dashboard(
        uid="sparseguard-silence",
        title="SparseGuard / Silence",
        description="Share of MLP channels that stay silent, per layer; a late-layer spike means "
        "the model may be out of its depth.",
        items=(
            Panel(
                "Silence rate per layer (5m window)",
                (per_layer("5m"),),
                kind="status-history",
                description="One row per layer, averaged over the selected models and levels.",
                unit="percentunit",
                width=24,
                height=14,
                min=0,
                max=1,
                color="continuous-YlRd",
            ),
            Panel(
                "Silence rate per layer (1h window)",
                (per_layer("1h"),),
                kind="bargauge",
                unit="percentunit",
                height=10,
                min=0,
                max=1,
                steps=((0.5, "orange"), (signals.spike_silence, "red")),
            ),
            Panel(
                "Silence spikes",
                (
                    Target(
                        rate("sparseguard_silence_spikes_total", "model, level"),
                        "{{model}} {{level}}",
                    ),
                ),
                description="Requests with a late-layer silence spike.",
                unit="reqps",
                height=10,
            ),
            Panel(
                "Share of requests with a spike (5m window)",
                (
                    Target(
                        f"{window('sparseguard_window_silence_spikes')} "
                        f"/ {window('sparseguard_window_requests')}",
                        "{{model}} {{level}}",
                    ),
                ),
                description="Above 5% of a window's requests the SilenceSpikes alert fires.",
                unit="percentunit",
                width=24,
                min=0,
                steps=((0.05, "red"),),
                show_thresholds="line",
            ),
        ),
    )
