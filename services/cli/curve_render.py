"""Training curves as a PNG: one panel per measured series against the step."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

Series = Sequence[tuple[float, float]]  # (x, value)


def render_curves(
    path: Path, title: str, panels: Mapping[str, Mapping[str, Series]], xlabel: str = "step"
) -> Path:
    """Write `panels` (panel title -> line label -> points) side by side to `path`."""
    if not panels:
        raise ValueError("nothing to draw: no curve has any point")
    figure, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
    for ax, (name, lines) in zip(axes[0], panels.items(), strict=True):
        for label, points in lines.items():
            if points:
                steps, values = zip(*points, strict=True)
                ax.plot(steps, values, marker="o" if len(points) < 20 else None, label=label)
        ax.set_title(name)
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
