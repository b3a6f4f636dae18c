"""The trust decision of one request, from its internal signals."""

from __future__ import annotations

from dataclasses import dataclass

from sparse_engine.recorder import SignalSummary

LATE_BAND = 3
SPIKE_THRESHOLD = 0.80


@dataclass(frozen=True, slots=True)
class Trust:
    score: float  # 1 - late-layer silence: low when the last layers go quiet
    late_silence: float
    spike: bool
    action: str  # none | flag

    def header(self) -> str:
        return f"{self.score:.3f}" + (";silence-spike" if self.spike else "")


def assess(signals: SignalSummary | None) -> Trust:
    """A silence spike (mean silence rate of the last layers above 0.80) marks low trust."""
    if signals is None or not signals.silence_rate_per_layer:
        return Trust(1.0, 0.0, False, "none")
    band = signals.silence_rate_per_layer[-LATE_BAND:]
    late = sum(band) / len(band)
    spike = late > SPIKE_THRESHOLD
    return Trust(round(1.0 - late, 4), late, spike, "flag" if spike else "none")
