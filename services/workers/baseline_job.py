"""The baseline job: measure the healthy baseline of the served calibrations that lack one, on
a worker, and publish them again with it, so the first serve need not wait minutes for the
baseline pass (`make run` calibrates with `--no-baseline`; `sparseguard up` queues this job).
Until a baseline arrives, reasons and window rules use the published numbers."""

from __future__ import annotations

import logging
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from services.config import Settings
from services.shared import baseline
from services.shared.engine import build_engine
from services.storage.repository import calibration_row, upsert_calibration
from services.telemetry.control import publish_calibration
from services.workers.jobs import ClaimedJob
from services.workers.recalibration import calibration_reason
from sparse_engine.calibration.store import Calibration, CalibrationNotFoundError, CalibrationStore
from sparse_engine.sparsity.plan import Level

log = logging.getLogger(__name__)


def missing_baselines(settings: Settings, weights_sha256: str) -> list[Calibration]:
    """The latest calibration of each sparse level that has no baseline yet."""
    store = CalibrationStore(settings.calibrations_dir)
    found = []
    for level in Level:
        if level is Level.DENSE:
            continue
        try:
            cal = store.latest(weights_sha256, level)
        except CalibrationNotFoundError:
            continue
        if cal.baseline is None:
            found.append(cal)
    return found


def measure_baselines(
    settings: Settings, sessions: sessionmaker[Session], job: ClaimedJob
) -> dict[str, Any]:
    lm = build_engine(settings, job.params.get("model")).lm
    cals = missing_baselines(settings, lm.weights_sha256)
    if not cals:
        log.info("job %d: every served calibration of %s has a baseline", job.id, lm.model_id)
        return {"versions": [], "requests": 0}
    sent = baseline.attach(settings, lm, cals)
    store = CalibrationStore(settings.calibrations_dir)
    for cal in cals:
        store.save(cal)  # the same version, now with its baseline
        with sessions.begin() as session:
            reason = calibration_reason(str(cal.data.get("reason", "cli")))  # as first recorded
            upsert_calibration(session, calibration_row(cal, reason))
        publish_calibration(settings.telemetry, cal, f"baseline:job-{job.id}")
        log.info("published %s with its healthy baseline", cal.version)
    return {
        "versions": [cal.version for cal in cals],
        "requests": sent,
    }
