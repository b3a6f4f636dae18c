"""The pure rolling-window fold: `apply(state, events) -> state`, no I/O.

Per (model, level) key every window keeps a fixed ring of time buckets (5m = 30 x 10 s,
1h = 60 x 60 s, 24h = 96 x 900 s by default), so memory per key is bounded whatever the traffic.
Buckets are aligned to the Unix epoch and chosen by EVENT time, not arrival. A bucket slot whose
time has left the window is recycled by the first event of a newer bucket that maps to it.

Lateness: each key's watermark is the largest event time it has seen; an event older than
`watermark - lateness_s` is dropped and counted (`late_dropped`), a newer late one lands in its
own bucket. `snapshot(state, now)` summarises, per window, the buckets whose start lies in
(now - span, now]: the bucket holding `now` and the ones before it, so the covered event time is
[start, end) with `end` the end of the bucket holding `now` (bucket granularity, by design).
`now` is meant to be at or after the watermark (the wall clock); an earlier `now` only sees
buckets not yet recycled.

What one event adds to a bucket is in `buckets`: a silence spike is an event whose
`trust_reasons` carry REASON_SILENCE_SPIKE (the gateway judged it against the signal settings;
the fold only counts it). Error events count in `requests` and `errors` only. Means skip missing
and non-finite values and keep their own denominators. Latency and TTFT go into fixed
log-spaced histograms (`histograms`), which add up exactly across buckets. Each (model, level)
key is folded by the one group member that owns its partition.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from services.aggregator.buckets import (
    CACHE,
    DRIFT,
    ENTROPY,
    GATE,
    LATE_SILENCE,
    SPARSITY,
    STABILITY,
    Bucket,
    observe,
)
from services.aggregator.references import (
    Reference,
    layer_shift,
    layer_sparsity,
    references,
    spread_ratio,
)
from services.aggregator.summary import WindowSummary
from services.config import SignalSettings
from services.telemetry.schema import TelemetryEvent

WINDOWS: dict[str, float] = {"5m": 300, "1h": 3600, "24h": 86400}
# The signals whose spread across a window's requests `spread_ratio` compares with healthy.
SPREAD_SIGNALS = {
    "sparsity": SPARSITY,
    "gate_confidence": GATE,
    "gate_entropy": ENTROPY,
    "late_silence": LATE_SILENCE,
}
DEFAULT_BUCKET_S: dict[str, float] = {"5m": 10, "1h": 60, "24h": 900}
Key = tuple[str, str]  # (model, level), the telemetry partition key
DENSE = "dense"


@dataclass(frozen=True)
class FoldConfig:
    bucket_s: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_BUCKET_S))
    lateness_s: float = 120.0
    # The healthy gate confidence band; the aggregator passes settings.signals.gate_band.
    gate_band: tuple[float, float] = field(default_factory=lambda: SignalSettings().gate_band)
    late_band: int = field(default_factory=lambda: SignalSettings().late_band)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.bucket_s) - set(WINDOWS))
        if not self.bucket_s or unknown:
            raise ValueError(f"bucket_s needs window names among {sorted(WINDOWS)}, got {unknown}")
        for window, size in self.bucket_s.items():
            if not size > 0 or abs(WINDOWS[window] / size - self.ring_size(window)) > 1e-9:
                raise ValueError(f"bucket_s[{window!r}]={size} must divide {WINDOWS[window]} s")
        if self.lateness_s < 0 or self.gate_band[0] > self.gate_band[1]:
            raise ValueError("need lateness_s >= 0 and gate_band (low, high)")

    def ring_size(self, window: str) -> int:
        return max(1, round(WINDOWS[window] / self.bucket_s[window]))


@dataclass(slots=True)
class Ring:
    bucket_s: float
    slots: list[Bucket | None]

    def bucket_for(self, index: int) -> Bucket | None:
        """The live bucket for `index`, recycling its slot if that holds an older bucket; None
        when a newer bucket already holds the slot (the event is older than this window)."""
        slot = index % len(self.slots)
        bucket = self.slots[slot]
        if bucket is None or bucket.index < index:
            bucket = self.slots[slot] = Bucket(index)
        return bucket if bucket.index == index else None

    def covering(self, last: int) -> Iterator[Bucket]:
        first = last - len(self.slots) + 1
        return (b for b in self.slots if b is not None and first <= b.index <= last)


@dataclass(slots=True)
class KeyState:
    rings: dict[str, Ring]
    watermark: float = -math.inf  # epoch seconds of the newest event time seen
    calibration: tuple[float, str] | None = None  # (event time, version) of the latest


@dataclass(slots=True)
class State:
    config: FoldConfig
    keys: dict[Key, KeyState] = field(default_factory=dict)
    events_applied: int = 0
    late_dropped: int = 0

    def watermark(self, key: Key) -> datetime | None:
        found = self.keys.get(key)
        return None if found is None else datetime.fromtimestamp(found.watermark, UTC)


def new_state(config: FoldConfig | None = None) -> State:
    return State(config=config or FoldConfig())


def _new_key(config: FoldConfig) -> KeyState:
    return KeyState(
        rings={
            w: Ring(bucket_s=size, slots=[None] * config.ring_size(w))
            for w, size in config.bucket_s.items()
        }
    )


def apply(state: State, events: Iterable[TelemetryEvent]) -> State:
    """Fold `events` into `state` (updated in place and returned); O(1) work per event."""
    for event in events:
        _apply_one(state, event)
    return state


def _apply_one(state: State, event: TelemetryEvent) -> None:
    key = (event.model, event.level)
    entry = state.keys.get(key)
    if entry is None:
        entry = state.keys[key] = _new_key(state.config)
    at = event.time.timestamp()
    if at < entry.watermark - state.config.lateness_s:
        state.late_dropped += 1
        return
    entry.watermark = max(entry.watermark, at)
    obs = observe(event, state.config.gate_band, state.config.late_band)
    if not obs.is_error and event.calibration_version is not None:
        entry.calibration = max(entry.calibration or (at, ""), (at, event.calibration_version))
    for ring in entry.rings.values():
        bucket = ring.bucket_for(math.floor(at / ring.bucket_s))
        if bucket is not None:
            bucket.add(obs)
    state.events_applied += 1


def snapshot(
    state: State,
    now: datetime,
    targets: Mapping[str, float] | None = None,
    baselines: Mapping[str, Mapping[str, Any] | None] | None = None,
    signals: SignalSettings | None = None,
) -> dict[Key, dict[str, WindowSummary]]:
    """Every key's summary per window at `now` (timezone-aware). `targets` and `baselines`
    map a calibration version to its calibrated sparsity target and its healthy baseline (the
    artefact's JSON), read for the key's latest version; `signals` gives the published
    numbers where no baseline exists (services/aggregator/references.py)."""
    if now.tzinfo is None:
        raise ValueError("now must be timezone-aware (pass datetime.now(UTC))")
    at = now.timestamp()
    found = {}
    for key, entry in state.keys.items():
        totals = {w: (ring, _total(ring, at)) for w, ring in entry.rings.items()}
        version = entry.calibration[1] if entry.calibration else None
        baseline = (baselines or {}).get(version) if version is not None else None
        refs = _references(
            key[1],
            signals or SignalSettings(),
            baseline,
            (targets or {}).get(version) if version is not None else None,
            totals.get("24h", (None, None))[1],
        )
        layers = layer_sparsity(baseline) if key[1] != DENSE else []
        z = (signals or SignalSettings()).alert_z
        found[key] = {
            w: _summarize(w, ring, total, at, version, refs, targets or {}, layers, z)
            for w, (ring, total) in totals.items()
        }
    return found


def _total(ring: Ring, at: float) -> Bucket:
    last = math.floor(at / ring.bucket_s)
    total = Bucket(last)
    for bucket in ring.covering(last):
        total.merge(bucket)
    return total


def _references(
    level: str,
    signals: SignalSettings,
    baseline: Mapping[str, Any] | None,
    target: float | None,
    day: Bucket | None,
) -> dict[str, Reference]:
    trailing = (
        (0, None, 0.0) if day is None else (day.counts[CACHE], day.mean(CACHE), day.sd(CACHE))
    )
    refs = references(signals, baseline, target, trailing)
    if level == DENSE:  # no sparsifier: no target, and no gate to judge
        for name in ("sparsity", "gate_confidence", "gate_entropy"):
            refs.pop(name, None)
    return refs


def _summarize(
    window: str,
    ring: Ring,
    total: Bucket,
    at: float,
    version: str | None,
    refs: dict[str, Reference],
    targets: Mapping[str, float],
    layers: list[Reference],
    z: float,
) -> WindowSummary:
    last = math.floor(at / ring.bucket_s)
    spreads = [
        (total.counts[i], total.sd(i), refs[name])
        for name, i in SPREAD_SIGNALS.items()
        if name in refs
    ]
    outside = total.gate_outside / total.counts[GATE] if total.counts[GATE] else None
    answered = total.requests - total.errors
    return WindowSummary(
        window=window,
        start=_utc((last - len(ring.slots) + 1) * ring.bucket_s),
        end=_utc((last + 1) * ring.bucket_s),
        requests=total.requests,
        errors=total.errors,
        error_rate=total.errors / total.requests if total.requests else 0.0,
        sparsity_mean=total.mean(SPARSITY),
        sparsity_target=targets.get(version) if version is not None else None,
        gate_confidence_mean=total.mean(GATE),
        gate_outside_band_share=outside,
        activation_stability_mean=total.mean(STABILITY),
        gate_entropy_mean=total.mean(ENTROPY),
        drift_kl_mean=total.mean(DRIFT),
        drift_samples=total.counts[DRIFT],
        silence_rate_per_layer=total.silence.means(),
        late_silence_mean=total.mean(LATE_SILENCE),
        sparsity_per_layer=total.sparsity.means(),
        layer_sparsity_shift=layer_shift(total.sparsity.sums, total.sparsity.counts, layers),
        signal_spread_ratio=spread_ratio(spreads, z),
        silence_spikes=total.spikes,
        silence_spike_share=total.spikes / answered if answered else None,
        trust_actions=dict(total.trust_actions),
        cache_hit_rate_mean=total.mean(CACHE),
        ttft_ms=total.ttft.quantiles(),
        latency_ms=total.latency.quantiles(),
        calibration_version=version,
        references=refs,
    )


def _utc(epoch_s: float) -> datetime:
    return datetime.fromtimestamp(epoch_s, UTC)
