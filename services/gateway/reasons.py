"""Why an answer's trust was lowered: each reason a test of one signal against the healthy
baseline of the answer's level and calibration version, firing on at most
`signals.reason_budget` of the healthy requests of each kind the baseline measured (the
kinds' own samples, each moved to the request's side of the system prompt), among the kinds
of the request's category (code or text, told from its user text: `prompt_category`), with
`signals.reason_confidence` over the draw of the baseline where its samples are large enough.
Without a baseline (a calibration made before baselines existed) the published numbers in the
signal settings apply, as before."""

from __future__ import annotations

import logging
import threading
import time

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
RECHECK_S = 30.0


class BaselineBook:
    """The baselines of the calibration versions served, read from the calibration store (the
    control listener saves every published calibration there): once for a version that has
    one, again every RECHECK_S for one that has none yet (the baseline job adds it later)."""

    def __init__(self, store: CalibrationStore | None) -> None:
        self._store = store
        self._by_version: dict[str, tuple[Calibration | None, float]] = {}
        self._parsed: dict[str, LevelBaseline] = {}
        self._lock = threading.Lock()
        self._dense: LevelBaseline | None = None
        self._dense_searched = -RECHECK_S

    def lookup(self, version: str | None, level: str) -> LevelBaseline | None:
        """The baseline of `level` under calibration `version` (dense: the dense baseline of
        the newest calibration seen), or None when none was measured."""
        if level == Level.DENSE.value:
            return self._dense or self._latest_dense()
        cal = self._calibration(version)
        if cal is None or cal.baseline is None or version is None:
            return None
        parsed = self._parsed.get(version)
        if parsed is None:  # read once: a version's baseline does not change once measured
            parsed = self._parsed[version] = LevelBaseline.from_dict(cal.baseline)
            if cal.dense_baseline is not None:
                self._dense = LevelBaseline.from_dict(cal.dense_baseline)
        return parsed

    def _calibration(self, version: str | None) -> Calibration | None:
        if version is None or self._store is None:
            return None
        with self._lock:
            cal, read_at = self._by_version.get(version, (None, -RECHECK_S))
            now = time.monotonic()
            if (cal is None or cal.baseline is None) and now - read_at >= RECHECK_S:
                try:
                    cal = self._store.load(version)
                except CalibrationNotFoundError:
                    log.warning(
                        "no artefact for %s: its reasons use the published numbers", version
                    )
                self._by_version[version] = (cal, now)
            return cal

    def _latest_dense(self) -> LevelBaseline | None:
        now = time.monotonic()
        if self._store is None or now - self._dense_searched < RECHECK_S:
            return None
        with self._lock:
            self._dense_searched = now  # a later calibration brings its own
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
    category: str | None = None,
    system: bool | None = None,
) -> tuple[str, ...]:
    """The reasons that lowered an answer's trust. With a `baseline`: a signal more unusual
    than `signals.reason_budget` of healthy requests. Without one: the published numbers in
    `signals` (and `z`, late-band silence in standard deviations above the level's rolling
    mean, None while that warms up). `flag_below`: the trust score's flag threshold.
    `category`: the request's (`prompt_category`); with a baseline, it is compared with the
    kinds of that category only (None: every kind). `system`: whether the request came with a
    system prompt (it moves the gate's entropy, README); None: unknown."""
    found = []
    late = sig.late_silence(signals.late_band)
    if baseline is not None:
        kinds = baseline.kinds_of(category)

        def above(signal: str, value: float) -> bool:
            stats = baseline.get(signal)
            return stats is not None and stats.unusual(
                value, signals.reason_budget, signals.reason_confidence, kinds, system
            )

        if above("late_silence", late):
            found.append(REASON_SILENCE_SPIKE)
        if not is_dense:  # a dense pass has no sparsifier whose gate could degrade
            if above("gate_entropy", sig.gate_entropy):
                found.append(REASON_GATE_DEGRADED)
            if above("gate_confidence", sig.gate_confidence):
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
