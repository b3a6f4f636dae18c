"""Why an answer's trust was lowered: each reason a test of one signal against the healthy
baseline of the answer's level and calibration version, firing on at most
`signals.reason_budget` of healthy requests (a conformal p-value from the baseline's sample).
Without a baseline (a calibration made before baselines existed) the published numbers in the
signal settings apply, as before."""

from __future__ import annotations

import logging
import threading

from services.config import SignalSettings
from services.telemetry.schema import (
    REASON_GATE_DEGRADED,
    REASON_LOW_SCORE,
    REASON_MONOTONOUS_INPUT,
    REASON_SILENCE_SPIKE,
)
from sparse_engine.calibration.baseline import LevelBaseline
from sparse_engine.calibration.store import Calibration, CalibrationNotFoundError, CalibrationStore
from sparse_engine.sparsity.plan import Level
from sparse_engine.trust.features import RequestSignals

log = logging.getLogger(__name__)


class BaselineBook:
    """The baselines of the calibration versions served, read once each from the calibration
    store (the control listener saves every published calibration there)."""

    def __init__(self, store: CalibrationStore | None) -> None:
        self._store = store
        self._by_version: dict[str, Calibration | None] = {}
        self._lock = threading.Lock()
        self._dense: LevelBaseline | None = None
        self._dense_searched = False

    def lookup(self, version: str | None, level: str) -> LevelBaseline | None:
        """The baseline of `level` under calibration `version` (dense: the dense baseline of
        the newest calibration seen), or None when none was measured."""
        if level == Level.DENSE.value:
            return self._dense or self._latest_dense()
        cal = self._calibration(version)
        if cal is None or cal.baseline is None:
            return None
        if cal.dense_baseline is not None:
            self._dense = LevelBaseline.from_dict(cal.dense_baseline)
        return LevelBaseline.from_dict(cal.baseline)

    def _calibration(self, version: str | None) -> Calibration | None:
        if version is None or self._store is None:
            return None
        with self._lock:
            if version not in self._by_version:
                try:
                    self._by_version[version] = self._store.load(version)
                except CalibrationNotFoundError:
                    log.warning(
                        "no artefact for %s: its reasons use the published numbers", version
                    )
                    self._by_version[version] = None
            return self._by_version[version]

    def _latest_dense(self) -> LevelBaseline | None:
        if self._store is None or self._dense_searched:
            return None
        with self._lock:
            self._dense_searched = True  # once: a later calibration brings its own
            found = [c.dense_baseline for c in self._store.list() if c.dense_baseline]
            if found:
                self._dense = LevelBaseline.from_dict(found[-1])
            return self._dense


def trust_reasons(
    sig: RequestSignals,
    score: float,
    signals: SignalSettings,
    flag_below: float,
    is_dense: bool = False,
    baseline: LevelBaseline | None = None,
    z: float | None = None,
) -> tuple[str, ...]:
    """The reasons that lowered an answer's trust. With a `baseline`: a signal more unusual
    than `signals.reason_budget` of healthy requests. Without one: the published numbers in
    `signals` (and `z`, late-band silence in standard deviations above the level's rolling
    mean, None while that warms up). `flag_below`: the trust score's flag threshold."""
    found = []
    late = sig.late_silence(signals.late_band)
    if baseline is not None:
        budget = signals.reason_budget
        if _above(baseline, "late_silence", late, budget):
            found.append(REASON_SILENCE_SPIKE)
        if not is_dense:  # a dense pass has no sparsifier whose gate could degrade
            if _above(baseline, "gate_entropy", sig.gate_entropy, budget):
                found.append(REASON_GATE_DEGRADED)
            if _above(baseline, "gate_confidence", sig.gate_confidence, budget):
                found.append(REASON_MONOTONOUS_INPUT)
    else:
        if late > signals.spike_silence or (z is not None and z > signals.spike_z):
            found.append(REASON_SILENCE_SPIKE)
        if not is_dense:
            if sig.gate_entropy > signals.gate_uniform_entropy:
                found.append(REASON_GATE_DEGRADED)
            if sig.gate_confidence > signals.monotonous_confidence:
                found.append(REASON_MONOTONOUS_INPUT)
    if score < flag_below:
        found.append(REASON_LOW_SCORE)
    return tuple(found)


def _above(baseline: LevelBaseline, signal: str, value: float, budget: float) -> bool:
    stats = baseline.get(signal)
    return stats is not None and stats.p_above(value) <= budget
