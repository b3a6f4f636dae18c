"""The per-request signals as pure tensor functions (definitions from the mission)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import torch

# The default of the last layers whose mean silence is the spike signal; the services pass
# their setting (settings.signals.late_band) wherever a band is read.
LATE_BAND = 3


def late_silence(silence_per_layer: Sequence[float], late_band: int = LATE_BAND) -> float:
    """Mean silence of the last `late_band` layers (all of them when there are fewer)."""
    band = silence_per_layer[-late_band:]
    return sum(band) / len(band) if band else 0.0


def zeroed_fraction(zeros: float, total: float) -> float:
    """Size-weighted sparsity: zeroed activations over all sparsified activations."""
    return zeros / total if total else 0.0


def kept_magnitude_share(magnitude: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Per-token share of |activation| the sparsifier kept: sum|kept| / sum|all| (last dim).
    `magnitude` is |x|, computed once by the caller."""
    return kept_share((magnitude * kept).sum(-1), magnitude.sum(-1))


def kept_share(kept: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """sum|kept| / sum|all| from the two sums; 1 where nothing was there to keep."""
    share = kept / total.clamp_min(torch.finfo(total.dtype).tiny)
    return torch.where(total > 0, share, torch.ones_like(share))


def coefficient_of_variation_pct(values: list[float]) -> float:
    """Standard deviation over mean, in percent; 0 for fewer than two values or a zero mean."""
    if len(values) < 2:
        return 0.0
    mean = sum(values) / len(values)
    if mean == 0:
        return 0.0
    var = sum((v - mean) ** 2 for v in values) / len(values)
    return 100.0 * math.sqrt(var) / mean


def entropy_bits_per_char(text: str) -> float:
    """Shannon entropy of the character distribution of `text`, in bits per character."""
    if not text:
        return 0.0
    counts = Counter(text)
    n = len(text)
    return -sum(c / n * math.log2(c / n) for c in counts.values())


# A request's category, told from its user text alone: a healthy baseline compares a request
# with the kinds of its own category, so code's loud late layers do not hide an unusual
# request of another category (`calibration.baseline`).
CODE, TEXT, DATA = "code", "text", "data"
_CODE_SYMBOLS = frozenset("{}()[];=<>_#\\*|&")


def prompt_category(text: str) -> str:
    """`data` for machine data, mostly ASCII: at least 40 visible characters, half of them
    digits (a window of a number table), or records, a quarter of the characters digits, under
    3 % code symbols and at least 4 lines, half of all, holding the same number of commas (a
    CSV window); `code` for text laid out as code: mostly ASCII, at least 4 non-blank lines,
    and either 3 % of its visible characters code symbols or a fifth of its lines indented;
    else `text`. On the packaged traffic: 85-89 % of code prompts (the rest are READMEs and
    articles, and a few tables in code), 2-3 % of chat and summary prompts, no QA, prose or
    garbage prompt, 1 of 80 multilingual ones are `code` (README, "Healthy baselines")."""
    visible = [c for c in text if not c.isspace()]
    lines = [line for line in text.split("\n") if line.strip()]
    if not visible or sum(c.isascii() for c in visible) < 0.9 * len(visible):
        return TEXT
    digits = sum(c.isdigit() for c in visible) / len(visible)
    symbols = sum(c in _CODE_SYMBOLS for c in visible) / len(visible)
    if len(visible) >= 40 and digits >= 0.5:
        return DATA
    if digits >= 0.25 and symbols < 0.03 and _records(lines):
        return DATA
    if len(lines) < 4:
        return TEXT
    indented = sum(line.startswith(("  ", "\t")) for line in lines) / len(lines)
    return CODE if symbols >= 0.03 or indented >= 0.2 else TEXT


def _records(lines: list[str]) -> bool:
    """At least 4 lines, and half of all, with the same number of commas (one or more)."""
    commas = Counter(line.count(",") for line in lines if "," in line)
    same = max(commas.values(), default=0)
    return same >= 4 and same >= 0.5 * len(lines)


def silence_rate(mean_magnitude: torch.Tensor, threshold: float) -> float:
    """Share of channels whose mean |activation| over the request stayed below the silence
    threshold. (SwiGLU channels of small models are almost never below a threshold on 95% of
    tokens, so a per-token rule reads 0 everywhere; the mean moves with the input.)"""
    if mean_magnitude.numel() == 0:
        return 0.0
    return float((mean_magnitude < threshold).float().mean())


def token_kl(dense_logits: torch.Tensor, sparse_logits: torch.Tensor) -> torch.Tensor:
    """KL(dense || sparse) per position, in nats, from logits of shape (positions, vocab)."""
    log_p = torch.log_softmax(dense_logits.float(), dim=-1)
    log_q = torch.log_softmax(sparse_logits.float(), dim=-1)
    return (log_p.exp() * (log_p - log_q)).sum(-1)


def entropy_nats(log_probs: torch.Tensor) -> torch.Tensor:
    """Entropy of the distributions given as log-probabilities (last dim), in nats."""
    return -(log_probs.exp() * log_probs).sum(-1)


def normalised_entropy(weights: torch.Tensor) -> float:
    """Entropy of a non-negative weight vector divided by its maximum, log(n); 1 is uniform."""
    total = weights.sum()
    if weights.numel() < 2 or total <= 0:
        return 0.0
    p = weights / total
    h = -(p * torch.log(p.clamp_min(1e-30))).sum()
    return float(h / math.log(weights.numel()))
