"""The Jobs dashboard: nightly golden-set drift against its budget, background job runs,
calibration reloads at the gateways and standing model flags."""

from __future__ import annotations

from dashboards.model import Dashboard, Panel, Target
from dashboards.promql import select
from services.config import SignalSettings

MAX_CHECK_AGE_S = 93_600  # 26 h, as the GoldenCheckMissed rule
RELOADS = select("sparseguard_calibration_reloads_total", 'level=~"$level"')
FLAGS = select("sparseguard_model_flag", 'model=~"$model"')


def jobs(signals: SignalSettings | None = None) -> Dashboard:
    """The dashboard with `signals`' drift budgets (default: the published ones)."""
    signals = signals or SignalSettings()
    budget, limit = signals.drift_budget, signals.drift_recalibrate
    return Dashboard(
        uid="sparseguard-jobs",
        title="SparseGuard / Jobs",
        description="Golden-set drift checks, recalibration jobs and model flags.",
        items=(
            Panel(
                "Golden-set drift per level (points)",
                (
                    Target(select("sparseguard_golden_drift_points"), "{{model}} {{level}} latest"),
                    Target(
                        select("sparseguard_golden_drift_low_points"), "{{model}} {{level}} low"
                    ),
                    Target(
                        select("sparseguard_golden_drift_low_24h_points"),
                        "{{model}} {{level}} low 24h",
                    ),
                ),
                description="Mean score(dense) - score(sparse) on the golden set (token F1 or "
                f"chrF against external references) and its 95 % interval's lower bound: over "
                f"budget when the low bound passes {budget:g}; a 24 h mean of low bounds above "
                f"{limit:g} queues a recalibration.",
                width=18,
                steps=((budget, "orange"), (limit, "red")),
                show_thresholds="line",
            ),
            Panel(
                "Golden check age",
                (Target("max(sparseguard_golden_check_age_seconds)", "age"),),
                kind="stat",
                unit="s",
                width=6,
                steps=((MAX_CHECK_AGE_S, "red"),),
            ),
            Panel(
                "Job runs by kind and status",
                (Target("max by (kind, status) (sparseguard_job_runs)", "{{kind}} {{status}}"),),
                description="Runs stored in the database.",
            ),
            Panel(
                "Calibration reloads at gateways",
                (Target(f"sum by (level) (increase({RELOADS}[$__rate_interval]))", "{{level}}"),),
                description="Calibration versions installed without a restart.",
            ),
            Panel(
                "Model flags",
                (Target(f"max by (model, flag) ({FLAGS})", "{{model}} {{flag}}"),),
                kind="state-timeline",
                width=24,
                steps=((1, "red"),),
            ),
        ),
    )
