"""Recalibration as a plain function of settings and a claimed job: calibrate one level on
recent traffic (when prompt text is kept) or the configured corpus, save the new version
atomically, register it in SQL with why it ran, and publish it on the control topic.

A job makes at most one version: the version records its job id, so a retried job (the worker
died after saving, say) finds it and only registers and publishes it again."""

from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from services.config import Settings
from services.shared import baseline
from services.shared.engine import build_engine
from services.storage.models import RequestSummary
from services.storage.repository import calibration_row, upsert_calibration
from services.telemetry.control import publish_calibration
from services.workers.jobs import ClaimedJob
from sparse_engine.calibration.pipeline import (
    CalibrationConfig,
    CalibrationData,
    calibrate,
    prepare_data,
)
from sparse_engine.calibration.store import Calibration, CalibrationStore
from sparse_engine.data import corpora
from sparse_engine.model.loader import LoadedModel
from sparse_engine.sparsity.plan import Level

log = logging.getLogger(__name__)
TRAFFIC_DOC_CHARS = 1000  # prompts are short: pack them into samples of about 256 tokens
TRAFFIC_SCAN_LIMIT = 20_000


def calibration_reason(job_reason: str) -> str:
    """The calibration record's reason category for a job's reason."""
    head = job_reason.split(":", 1)[0]
    if head in ("alert", "golden-drift"):
        return "alert"
    return head if head in ("schedule", "operator", "cli") else "operator"


def recalibrate(
    settings: Settings, sessions: sessionmaker[Session], job: ClaimedJob
) -> dict[str, Any]:
    level = Level.parse(str(job.params.get("level") or settings.engine.default_level))
    if level is Level.DENSE:
        raise ValueError("the dense level needs no calibration; choose a sparse level")
    # The engine as the gateway serves it; calibration reads its model through hooks.
    lm = build_engine(settings, job.params.get("model")).lm
    store = CalibrationStore(settings.calibrations_dir)
    done = [c for c in store.list(lm.weights_sha256) if c.data.get("job_id") == job.id]
    if done:
        cal = done[-1]
        log.info("job %d already made %s; registering and publishing it", job.id, cal.version)
    else:
        cal = _calibrate(settings, sessions, lm, level, job)
        store.save(cal)  # atomic: a crash before this line leaves no version at all
    if cal.baseline is None:  # measured on the engine that serves the new plan
        baseline.attach(settings, lm, [cal])
        store.save(cal)
    reason = calibration_reason(job.reason)
    with sessions.begin() as session:
        upsert_calibration(session, calibration_row(cal, reason))
    publish_calibration(settings.telemetry, cal, job.reason)
    log.info("published %s (%s)", cal.version, job.reason)
    return {
        "version": cal.version,
        "level": cal.level,
        "realised_sparsity": cal.realised_sparsity,
        "perplexity_change_pct": round(cal.perplexity_change_pct, 3),
        "data": cal.data.get("corpus"),
    }


def _calibrate(
    settings: Settings,
    sessions: sessionmaker[Session],
    lm: LoadedModel,
    level: Level,
    job: ClaimedJob,
) -> Calibration:
    cfg = CalibrationConfig(
        samples=settings.engine.calibration_samples,
        seq_len=settings.engine.seq_len,
        sensitivity_tokens=settings.engine.sensitivity_tokens,
        heldout_tokens=settings.engine.heldout_tokens,
    )
    data = _data(settings, sessions, lm, cfg)
    log.info("job %d: calibrating %s on %s", job.id, level.value, data.name)
    (cal,) = calibrate(lm, data, [level], cfg)
    cal.data.update({"job_id": job.id, "reason": job.reason})
    return cal


def _data(
    settings: Settings, sessions: sessionmaker[Session], lm: LoadedModel, cfg: CalibrationConfig
) -> CalibrationData:
    """Recent traffic when prompt text is kept and there is enough of it, else the corpus."""
    if settings.telemetry.keep_prompt_text:
        since = datetime.now(UTC) - timedelta(hours=settings.jobs.traffic_window_h)
        with sessions() as session:
            prompts = recent_prompts(session, lm.model_id, since)
        if len(prompts) >= settings.jobs.traffic_min_prompts:
            try:
                return prepare_data(lm.tokenizer, pack(prompts), cfg, "traffic")
            except ValueError as exc:
                log.warning("recent traffic is not enough to calibrate (%s); using the corpus", exc)
        else:
            log.info(
                "%d kept prompts in the last %g h (need %d); using the corpus",
                len(prompts),
                settings.jobs.traffic_window_h,
                settings.jobs.traffic_min_prompts,
            )
    name = settings.engine.calibration_corpus
    per_source = settings.engine.per_source_for(name)
    texts, sources = corpora.load_sourced(name, settings.cache_home, per_source)
    return prepare_data(lm.tokenizer, texts, cfg, name, sources)


def recent_prompts(session: Session, model: str, since: datetime) -> list[str]:
    """Prompt texts kept in recent request events of `model`, newest first."""
    events = session.scalars(
        select(RequestSummary.event)
        .where(RequestSummary.model == model, RequestSummary.time >= since)
        .order_by(RequestSummary.time.desc())
        .limit(TRAFFIC_SCAN_LIMIT)
    )
    return [e["prompt_text"] for e in events if isinstance(e.get("prompt_text"), str)]


def pack(prompts: list[str], size: int = TRAFFIC_DOC_CHARS) -> list[str]:
    """Join short prompts into documents of about `size` characters."""
    docs: list[str] = []
    current: list[str] = []
    length = 0
    for prompt in prompts:
        current.append(prompt)
        length += len(prompt)
        if length >= size:
            docs.append("\n\n".join(current))
            current, length = [], 0
    if current:
        docs.append("\n\n".join(current))
    return docs
