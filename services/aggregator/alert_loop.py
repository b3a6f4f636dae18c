"""Alert evaluation where the complete windows are: every interval, the owned windows (and
pipeline figures) go through the pure evaluator; transitions are stored as alert history,
notifications go to the webhook outbox in the same transaction (a crash never loses one).
A `recalibrate` action stores a recalibration job in that transaction too and sends its Celery
task after the commit (the beat's redispatch sweep sends it if that fails); `flag_finetune`
raises the model's fine-tune flag."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import cast

from celery import Celery
from prometheus_client import CollectorRegistry, Counter
from sqlalchemy.orm import Session, sessionmaker

from alerts.evaluator import EvalState, Sample, Transition, evaluate, group, samples_from_windows
from alerts.payload import AlertNotice, build_payload
from alerts.rules import DEFAULT_RULES, Rule, load_rules
from alerts.templates import render_all
from services.aggregator.summary import WindowSummary
from services.alerting.outbox import enqueue
from services.config import AlertSettings, SignalSettings
from services.shared.metrics_table import MetricSpec, declare
from services.storage.models import AlertRecord
from services.storage.repository import set_flag
from services.workers import jobs

log = logging.getLogger(__name__)
Snapshot = dict[tuple[str, str], dict[str, WindowSummary]]
Exemplars = Mapping[tuple[str, str], Sequence[str]]  # trace ids per (model, level), oldest first
ALERTING_METRICS = (
    MetricSpec("alert_transitions_total", Counter, "Alert state changes", ("alertname", "state")),
    MetricSpec("alert_actions_total", Counter, "Actions requested by alerts", ("action",)),
)


class AlertLoop:
    def __init__(
        self,
        settings: AlertSettings,
        sessions: sessionmaker[Session],
        registry: CollectorRegistry,
        external_url: str = "http://127.0.0.1:8001",
        celery: Celery | None = None,
        signals: SignalSettings | None = None,
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        # Rules name signal settings ({signal: gate_band}); the service passes settings.signals.
        thresholds = (signals or SignalSettings()).as_thresholds()
        self.rules: list[Rule] = load_rules(settings.rules_file or DEFAULT_RULES, thresholds)
        self.state = EvalState()
        self.external_url = external_url
        self.celery = celery  # None: jobs stay queued until the redispatch sweep sends them
        self.exemplars: Exemplars = {}
        metrics = declare(registry, ALERTING_METRICS)
        self.transitions_total = cast(Counter, metrics["alert_transitions_total"])
        self.actions_total = cast(Counter, metrics["alert_actions_total"])

    def tick(
        self,
        snapshot: Snapshot,
        pipeline: list[Sample],
        now: datetime | None = None,
        exemplars: Exemplars | None = None,
    ) -> list[Transition]:
        """One evaluation: returns the transitions, already stored and queued. `exemplars`:
        the latest requests' trace ids per (model, level), named in an alert's annotations
        (`trace_ids`) and carried by the jobs it queues, so an alert leads to its traces."""
        now = now or datetime.now(UTC)
        self.exemplars = exemplars or {}
        samples = samples_from_windows(snapshot) + pipeline
        self.state, transitions = evaluate(
            self.state, self.rules, samples, now, self.settings.repeat_interval_s
        )
        queued: list[int] = []
        if transitions:
            with self.sessions.begin() as session:
                queued = self._store(session, transitions, now)
        if self.celery is not None:
            for job_id in queued:
                jobs.dispatch(self.celery, job_id, "recalibrate")
        return transitions

    def _store(self, session: Session, transitions: list[Transition], now: datetime) -> list[int]:
        """Store history, outbox rows and actions; returns the recalibration jobs queued."""
        queued: list[int] = []
        for t in transitions:
            self.transitions_total.labels(t.rule.name, t.state).inc()
            session.add(_history(t, now, self._traces(t)))
            if t.notify and t.state == "firing":
                queued += self._actions(session, t)
        notify = [t for t in transitions if t.notify and "webhook" in t.rule.actions]
        for key, members in group(notify, self.settings.group_by).items():
            group_labels = dict(zip(self.settings.group_by, key, strict=False))
            for receiver in self.settings.receivers:
                payload = build_payload(
                    receiver.name,
                    [_notice(t, self.external_url, self._traces(t)) for t in members],
                    group_labels,
                    self.external_url,
                )
                enqueue(session, receiver.name, members[0].fingerprint, payload)
        return queued

    def _actions(self, session: Session, t: Transition) -> list[int]:
        """Every non-webhook action is counted and logged; returns recalibration jobs stored.
        (`fallback` is a per-request gateway decision; here it is recorded.)"""
        queued = []
        for action in t.rule.actions:
            if action == "webhook":
                continue
            self.actions_total.labels(action).inc()
            log.warning("alert %s requests %s for %s", t.rule.name, action, t.labels)
            details = {"labels": t.labels, "fingerprint": t.fingerprint, "value": t.value}
            if action == "recalibrate" and t.labels.get("level", "dense") != "dense":
                params = {"level": t.labels["level"], **details}
                reason, traces = f"alert:{t.rule.name}", self._traces(t)
                trace = traces[0] if traces else None  # the latest request of the key
                queued.append(jobs.create_job(session, action, reason, params, trace).id)
            elif action == "flag_finetune" and "model" in t.labels:
                set_flag(session, t.labels["model"], "finetune", f"alert:{t.rule.name}", details)
        return queued

    def _traces(self, t: Transition) -> list[str]:
        """The latest trace ids of the alert's model and level, newest first."""
        key = (t.labels.get("model", ""), t.labels.get("level", ""))
        return list(reversed(self.exemplars.get(key, ())))


def _annotations(t: Transition, traces: list[str]) -> dict[str, str]:
    rendered = render_all(t.rule.annotations, t.labels, t.value)
    return rendered | ({"trace_ids": ",".join(traces)} if traces else {})


def _history(t: Transition, now: datetime, traces: list[str]) -> AlertRecord:
    return AlertRecord(
        fingerprint=t.fingerprint,
        name=t.rule.name,
        state=t.state,
        severity=t.rule.severity,
        labels=t.labels,
        annotations=_annotations(t, traces),
        value=t.value,
        starts_at=t.active_since,
        ends_at=now if t.state == "resolved" else None,
        updated_at=now,
    )


def _notice(t: Transition, external_url: str, traces: list[str]) -> AlertNotice:
    return AlertNotice(
        status="resolved" if t.state == "resolved" else "firing",
        labels=dict(t.labels),
        annotations=_annotations(t, traces),
        starts_at=t.active_since,
        ends_at=t.at if t.state == "resolved" else None,
        fingerprint=t.fingerprint,
        generator_url=f"{external_url}/windows",
    )
