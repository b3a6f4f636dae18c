"""The text tables of `sparseguard eval alerts`."""

from __future__ import annotations

from typing import Any


def render(figures: dict[str, Any], budget: float) -> str:
    cfg = figures["config"]
    lines = [
        f"Replay at {cfg['rate_per_min']:g} requests/min/level; healthy: "
        f"{cfg['healthy_hours']:g} h of every level; each fault: {cfg['warmup_s'] / 60:g} min "
        f"healthy, {cfg['fault_s'] / 60:g} min of the fault at {cfg['fault_level']}, then healthy.",
        "",
        "Rule                     firings  precision  faults  recall  detect(min)  reset(min)",
    ]
    for r in figures["rules"]:
        lines.append(
            f"{r['rule']:<24} {r['firings']:>7}  {_share(r['precision']):>9}  "
            f"{r['detected_faults']}/{r['intended_faults']:<4}  {_share(r['recall']):>6}  "
            f"{_minutes(r['median_detection_s']):>11}  {_minutes(r['median_reset_s']):>10}"
        )
    lines += ["", "Fault              intended rule            detect(min)  reset(min)  also fired"]
    for f in figures["faults"]:
        lines.append(
            f"{f['fault']:<18} {f['intended']:<24} {_minutes(f['detected_s']):>11}  "
            f"{_minutes(f['reset_s']):>10}  {', '.join(f['also_fired']) or '-'}"
        )
    healthy = figures["healthy_alerts"]
    lines += ["", f"Alerts in the healthy replay: {len(healthy)}"]
    lines += [_alert(a) for a in healthy]
    lines += ["", f"Reasons on healthy held-out requests (budget {budget:.0%} each; 95% interval)"]
    lines += _reason_table(figures["reasons_healthy"]["by_level"])
    lines += ["", "... by kind of traffic (all levels)"]
    lines += _reason_table(figures["reasons_healthy"]["by_kind"])
    lines += ["", "Reasons on faulty requests"]
    lines += _reason_table(figures["reasons_faults"])
    for key, how in (
        ("reasons_every_kind", "against every kind whatever their category"),
        ("reasons_pooled", "against the pooled sample"),
    ):
        lines += ["", f"The same sparse-level requests tested {how}, by kind"]
        lines += _reason_table(figures[key]["healthy"]["by_kind"])
        lines += ["", "... and on faulty requests"]
        lines += _reason_table(figures[key]["faults"])
    lines += ["", "Trust actions on healthy chat (flag budget applies to low-score)"]
    for level, rate in figures["trust_actions_chat"].items():
        lines.append(f"  {level:<12} {rate_text(rate)}")
    unseen = figures["unseen_kinds"]
    lines += [
        "",
        f"Baseline of {'+'.join(unseen['baseline_kinds'])} only, replayed on "
        f"{'+'.join(unseen['checked_kinds'])}: {len(unseen['alerts'])} alerts",
    ]
    lines += [
        f"  {a['rule']} on {a['level']} at {_minutes(a['start_s'])} min" for a in unseen["alerts"]
    ]
    lines += _reason_table(unseen["reasons"])
    return "\n".join(lines)


def _alert(a: dict[str, Any]) -> str:
    return f"  {a['rule']} on {a['level']} at {_minutes(a['start_s'])} min"


def _reason_table(rows: dict[str, dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    reasons = list(next(iter(rows.values())))
    lines = ["  " + f"{'':<16}" + "".join(f"{r:<26}" for r in reasons)]
    for name, by_reason in rows.items():
        lines.append(
            "  " + f"{name:<16}" + "".join(f"{rate_text(by_reason[r]):<26}" for r in reasons)
        )
    return lines


def rate_text(rate: dict[str, Any]) -> str:
    """A rate as `share (hits/n; 95 % interval)`."""
    low, high = rate["ci95"]
    return f"{rate['share']:.1%} ({rate['hits']}/{rate['n']}; {low:.1%}-{high:.1%})"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _minutes(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds / 60:.1f}"
