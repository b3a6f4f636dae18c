"""Ranking quality: AUROC as the Mann-Whitney U statistic over average ranks."""

from __future__ import annotations

from collections.abc import Sequence


def auroc(scores: Sequence[float], positives: Sequence[bool]) -> float:
    """Probability that a random positive scores above a random negative (ties count half):
    the Mann-Whitney U statistic over average ranks. NaN when a class is empty."""
    n_pos = sum(positives)
    n_neg = len(positives) - n_pos
    if not n_pos or not n_neg:
        return float("nan")
    ranks = _average_ranks(scores)
    rank_sum = sum(r for r, p in zip(ranks, positives, strict=True) if p)
    return (rank_sum - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def _average_ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for k in range(start, end + 1):
            ranks[order[k]] = (start + end) / 2 + 1
        start = end + 1
    return ranks
