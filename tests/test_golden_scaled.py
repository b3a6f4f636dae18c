"""`scale_to_sparsity` on the tiny model: one factor on every threshold, found by bisection so
the realised sparsity reaches the target, up or down from the plan's own; bad input refused."""

from __future__ import annotations

import pytest
import torch

from sparse_engine.evaluation.perplexity import perplexity
from sparse_engine.runtime.engine import Engine
from sparse_engine.sparsity.plan import Level, SparsityPlan
from sparse_engine.sparsity.scaled import TOLERANCE, realised_sparsity, scale, scale_to_sparsity
from tests.tiny import SAMPLE_TEXT, tiny_engine


@pytest.fixture(scope="module")
def tiny() -> Engine:
    return tiny_engine(cache=False)


@pytest.fixture(scope="module")
def ids(tiny: Engine) -> torch.Tensor:
    return torch.tensor(tiny.lm.tokenizer(SAMPLE_TEXT * 3)["input_ids"][:128])


@pytest.mark.parametrize("target", [0.8, 0.2])
def test_the_plan_is_scaled_to_the_target_by_one_factor(
    tiny: Engine, ids: torch.Tensor, target: float
) -> None:
    plan = tiny.plan(Level.BALANCED)  # about 50 % on its calibration text
    scaled = scale_to_sparsity(tiny.lm, plan, ids, target)
    assert abs(realised_sparsity(tiny.lm, scaled, ids) - target) <= TOLERANCE
    # the perplexity utility measures it too (on all tokens but the last)
    scored = perplexity(tiny.lm.model, tiny.lm.layers, ids, scaled).sparsity
    assert scored == pytest.approx(target, abs=2 * TOLERANCE)
    factors = {
        s / t for s, t in zip(scaled.thresholds["down"], plan.thresholds["down"], strict=True)
    }
    assert max(factors) == pytest.approx(min(factors))
    assert (min(factors) > 1.0) == (target > realised_sparsity(tiny.lm, plan, ids))
    assert scaled.level is Level.BALANCED
    assert scaled.calibration_version is not None
    assert scaled.calibration_version.startswith("tiny-balanced*x")


def test_a_plan_already_at_the_target_is_returned_as_is(tiny: Engine, ids: torch.Tensor) -> None:
    plan = tiny.plan(Level.BALANCED)
    reached = realised_sparsity(tiny.lm, plan, ids)
    assert scale_to_sparsity(tiny.lm, plan, ids, reached) is plan
    assert scale(plan, 2.0).thresholds["down"][0] == pytest.approx(2 * plan.thresholds["down"][0])


@pytest.mark.parametrize(
    ("plan", "target", "bad_ids", "error"),
    [
        (None, 1.0, None, "between 0 and 1"),
        (None, 0.0, None, "between 0 and 1"),
        (SparsityPlan(Level.BALANCED), 0.8, None, "needs a threshold plan"),
        (SparsityPlan(Level.BALANCED, topk=(4, 4)), 0.8, None, "needs a threshold plan"),
        (None, 0.8, torch.tensor([], dtype=torch.long), "non-empty 1-D"),
        (None, 0.8, torch.tensor([[1, 2]]), "non-empty 1-D"),
    ],
)
def test_bad_input_is_refused(
    tiny: Engine,
    ids: torch.Tensor,
    plan: SparsityPlan | None,
    target: float,
    bad_ids: torch.Tensor | None,
    error: str,
) -> None:
    given = ids if bad_ids is None else bad_ids
    with pytest.raises(ValueError, match=error):
        scale_to_sparsity(tiny.lm, plan or tiny.plan(Level.BALANCED), given, target)
