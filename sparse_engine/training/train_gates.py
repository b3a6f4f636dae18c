"""Train learned gates (`sparsity.gates`) on a frozen model: distillation KL to the dense
model plus a hinge on the share of channels kept above `1 - target`, the target rising from 0
over the first `ramp` of the steps. Only the gates learn; the model's weights never change.
Each step runs the dense model once (no gradient) and the gated model forward and backward."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from sparse_engine.evaluation.perplexity import perplexity
from sparse_engine.model.loader import LoadedModel
from sparse_engine.sparsity.gates import DEFAULT_RANK, Gates, gated
from sparse_engine.sparsity.plan import SparsityPlan

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GateTraining:
    steps: int = 300
    batch: int = 4
    seq_len: int = 128
    rank: int = DEFAULT_RANK
    lr: float = 1e-3  # the low-rank weights'; the biases learn at 10x this
    target: float = 0.6  # the channel sparsity the hinge pushes toward
    ramp: float = 0.5  # share of the steps over which the target rises from 0
    penalty: float = 2.0  # weight of the hinge
    eval_every: int = 50
    seed: int = 0

    def check(self) -> None:
        if self.steps < 1 or self.batch < 1 or self.seq_len < 2 or self.rank < 1:
            raise ValueError("--steps, --batch and --rank must be >= 1 and --seq-len >= 2")
        if not 0.0 < self.target < 1.0 or not 0.0 < self.ramp <= 1.0:
            raise ValueError("--target-sparsity must be in (0, 1) and the ramp in (0, 1]")

    def goal(self, step: int) -> float:
        """The kept share allowed at `step` (1 - the ramped target)."""
        return 1.0 - self.target * min(1.0, step / max(1.0, self.ramp * self.steps))


@dataclass(frozen=True, slots=True)
class CurvePoint:
    step: int
    seconds: float
    loss: float
    kl: float
    sparsity: float  # share of channels closed on the step's batch (hard decisions)
    heldout_ppl: float | None = None
    heldout_sparsity: float | None = None

    def to_dict(self) -> dict[str, float | int | None]:
        return asdict(self)


@dataclass(slots=True)
class TrainedGates:
    gates: Gates
    curve: list[CurvePoint]
    dense_ppl: float
    seconds: float


def train_gates(
    lm: LoadedModel,
    sequences: Sequence[torch.Tensor],
    heldout: torch.Tensor,
    cfg: GateTraining,
    prefix: Sequence[int] = (),
    progress: Callable[[CurvePoint], None] | None = None,
) -> TrainedGates:
    """Gates for every MLP of `lm`, trained on crops of `sequences` (1-D token tensors of at
    least `cfg.seq_len` tokens, each after `prefix`), judged on `heldout` every `eval_every`
    steps and at the end."""
    cfg.check()
    usable = [s for s in sequences if s.numel() >= cfg.seq_len]
    if not usable:
        raise ValueError(f"no training sequence holds --seq-len {cfg.seq_len} tokens")
    torch.manual_seed(cfg.seed)
    generator = torch.Generator().manual_seed(cfg.seed)
    hidden = int(lm.model.config.hidden_size)
    gates = Gates.for_layers(lm.layers, hidden, cfg.rank)
    optimiser = torch.optim.Adam(
        [
            {"params": [*gates.down, *gates.up], "lr": cfg.lr},
            {"params": list(gates.bias), "lr": 10 * cfg.lr},
        ]
    )
    dense = perplexity(lm.model, lm.layers, heldout, SparsityPlan(), prefix=prefix).perplexity
    started, curve = time.monotonic(), []
    frozen = [p.requires_grad for p in lm.model.parameters()]
    lm.model.requires_grad_(False)
    try:
        for step in range(1, cfg.steps + 1):
            ids = _batch(usable, cfg, prefix, generator)
            point = _step(lm, gates, optimiser, ids, cfg.goal(step), cfg.penalty, step, started)
            if step % cfg.eval_every == 0 or step == cfg.steps:
                point = _judged(lm, gates, heldout, prefix, point)
            curve.append(point)
            if progress is not None:
                progress(point)
    finally:
        for p, flag in zip(lm.model.parameters(), frozen, strict=True):
            p.requires_grad_(flag)
    gates.requires_grad_(False)
    return TrainedGates(gates, curve, dense, time.monotonic() - started)


def _batch(
    sequences: list[torch.Tensor],
    cfg: GateTraining,
    prefix: Sequence[int],
    generator: torch.Generator,
) -> torch.Tensor:
    rows = []
    for pick in torch.randint(len(sequences), (cfg.batch,), generator=generator).tolist():
        seq = sequences[pick]
        start = int(torch.randint(seq.numel() - cfg.seq_len + 1, (1,), generator=generator))
        rows.append(
            torch.cat([torch.tensor(list(prefix), dtype=seq.dtype), seq[start:][: cfg.seq_len]])
        )
    return torch.stack(rows)


def _step(
    lm: LoadedModel,
    gates: Gates,
    optimiser: torch.optim.Optimizer,
    ids: torch.Tensor,
    goal: float,
    penalty: float,
    step: int,
    started: float,
) -> CurvePoint:
    with torch.no_grad():
        teacher = F.log_softmax(lm.model(input_ids=ids).logits.float(), dim=-1)
    actives: list[torch.Tensor] = []
    with gated(lm.layers, gates, straight_through=True, actives=actives):
        student = F.log_softmax(lm.model(input_ids=ids).logits.float(), dim=-1)
    kl = F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1).mean()
    kept = torch.stack(actives).mean()
    loss = kl + penalty * F.relu(kept - goal)
    optimiser.zero_grad(set_to_none=True)
    loss.backward()  # type: ignore[no-untyped-call]
    optimiser.step()
    return CurvePoint(
        step,
        time.monotonic() - started,
        float(loss.detach()),
        float(kl.detach()),
        1.0 - float(kept.detach()),
    )


def _judged(
    lm: LoadedModel,
    gates: Gates,
    heldout: torch.Tensor,
    prefix: Sequence[int],
    point: CurvePoint,
) -> CurvePoint:
    result = perplexity(lm.model, lm.layers, heldout, SparsityPlan(gates=gates), prefix=prefix)
    log.info(
        "step %d: held-out perplexity %.3f at %.1f%% channel sparsity",
        point.step,
        result.perplexity,
        100 * result.sparsity,
    )
    values = {**point.to_dict(), "heldout_ppl": result.perplexity}
    values["heldout_sparsity"] = result.sparsity
    return CurvePoint(**values)  # type: ignore[arg-type]
