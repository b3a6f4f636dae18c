"""The Celery task names: what clients send and the worker registers. A module of constants,
so the app, the tasks and the job table share them without importing each other."""

from __future__ import annotations

TASKS = {
    "recalibrate": "sparseguard.recalibrate",
    "golden_check": "sparseguard.golden_check",
    "trust_fit": "sparseguard.trust_fit",
    "baseline": "sparseguard.baseline",
}
NIGHTLY_GOLDEN = "sparseguard.golden_nightly"
SCHEDULED_RECALIBRATION = "sparseguard.recalibrate_scheduled"
REDISPATCH = "sparseguard.redispatch"
