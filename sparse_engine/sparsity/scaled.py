"""A threshold plan pushed to a target sparsity: every threshold multiplied by one factor, the
factor found by bisection on the sparsity the plan realises over given tokens (measured by the
`SignalRecorder` inside the hooks, as perplexity and calibration measure it). For fault
injection and for
measuring what a check sees when sparsity goes too far (e.g. 80 %, far past any calibration's
quality budget)."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from sparse_engine.model.loader import LoadedModel
from sparse_engine.sparsity.hooks import sparsified
from sparse_engine.sparsity.plan import SparsityPlan
from sparse_engine.sparsity.recorder import SignalRecorder

log = logging.getLogger(__name__)

TOLERANCE = 0.005  # realised sparsity within this of the target is close enough
MAX_STEPS = 40  # per search phase; doubling 40 times covers any threshold scale
CHUNK = 512  # tokens per forward pass, as `evaluation.perplexity` scores them


def scale_to_sparsity(
    lm: LoadedModel, plan: SparsityPlan, token_ids: torch.Tensor, target: float
) -> SparsityPlan:
    """`plan` with its thresholds multiplied by the one factor whose realised sparsity on
    `token_ids` (1-D) is within TOLERANCE of `target`; the closest found (with a warning) when
    sparsity jumps past the tolerance band."""
    _check(plan, token_ids, target)
    low, high = 0.0, 1.0
    best = (abs(realised_sparsity(lm, plan, token_ids) - target), 1.0)
    if best[0] <= TOLERANCE:
        return plan
    for _ in range(MAX_STEPS):  # bracket: grow the factor until the target is passed
        reached = realised_sparsity(lm, scale(plan, high), token_ids)
        best = min(best, (abs(reached - target), high))
        if reached >= target:
            break
        low, high = high, high * 2.0
    else:
        raise ValueError(f"thresholds x{high:g} still realise under {target:.0%} sparsity")
    for _ in range(MAX_STEPS):
        if best[0] <= TOLERANCE:
            break
        middle = (low + high) / 2.0
        reached = realised_sparsity(lm, scale(plan, middle), token_ids)
        best = min(best, (abs(reached - target), middle))
        low, high = (middle, high) if reached < target else (low, middle)
    if best[0] > TOLERANCE:
        log.warning("closest realised sparsity is %.3f off the target %.3f", best[0], target)
    log.info("thresholds x%.4g realise %.1f%% sparsity", best[1], 100 * target)
    return scale(plan, best[1])


def scale(plan: SparsityPlan, factor: float) -> SparsityPlan:
    """Every threshold times `factor`; the version says so (`<version>*x<factor>`)."""
    thresholds = {role: tuple(t * factor for t in per) for role, per in plan.thresholds.items()}
    version = f"{plan.calibration_version or 'uncalibrated'}*x{factor:.4g}"
    return replace(plan, thresholds=thresholds, calibration_version=version)


def realised_sparsity(lm: LoadedModel, plan: SparsityPlan, token_ids: torch.Tensor) -> float:
    """The share of sparsified activations the plan zeroes over `token_ids`, in independent
    chunks of CHUNK tokens."""
    recorder = SignalRecorder(lm.num_layers)
    with torch.inference_mode(), sparsified(lm.layers, plan, recorder):
        for start in range(0, token_ids.numel(), CHUNK):
            lm.model(input_ids=token_ids[start : start + CHUNK].unsqueeze(0))
    return recorder.summary().sparsity_ratio


def _check(plan: SparsityPlan, token_ids: torch.Tensor, target: float) -> None:
    if not 0.0 < target < 1.0:
        raise ValueError(f"target sparsity must be between 0 and 1 (exclusive), got {target}")
    if not any(any(t > 0 for t in per) for per in plan.thresholds.values()):
        raise ValueError(
            "scale_to_sparsity needs a threshold plan with a positive threshold (a Top-K or "
            "dense plan has none to scale); calibrate with --sparsifier threshold"
        )
    if token_ids.ndim != 1 or token_ids.numel() == 0:
        raise ValueError("token_ids must be a non-empty 1-D tensor of token ids")
