"""Train learned gates (`sparsity.gates`) on a frozen model: distillation KL to the dense
model plus a hinge on the share of channels kept above `1 - target`, the target rising from 0
over the first `ramp` of the steps. Only the gates learn; the model's weights never change.
Each step runs the dense model once (no gradient) and the gated model forward and backward.
The gates start open (`init="open"`: every gate at 0.5, the dense model), from the closed-form
fit of `gate_fit` (`init="fit"`), which already predicts the channels' magnitudes, or from a
gate artefact (`init=PATH`: training goes on from it). With `steps=0` the start is the result."""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from sparse_engine.evaluation.perplexity import perplexity
from sparse_engine.model.loader import LoadedModel
from sparse_engine.sparsity.gates import DEFAULT_RANK, Gates, gated, load_gates
from sparse_engine.sparsity.plan import SparsityPlan
from sparse_engine.training.gate_fit import fit_gates

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
    init: str = "open"  # "open", "fit" (`gate_fit.fit_gates`) or a gate artefact's path
    fit_sequences: int = 64  # training sequences the fit reads

    def check(self) -> None:
        if (
            self.steps < (0 if self.init != "open" else 1)
            or self.batch < 1
            or self.seq_len < 2
            or self.rank < 1
        ):
            raise ValueError(
                "--batch and --rank must be >= 1, --seq-len >= 2 and --steps >= 1 "
                "(>= 0 with --init fit or FILE)"
            )
        if not 0.0 < self.target < 1.0 or not 0.0 < self.ramp <= 1.0:
            raise ValueError("--target-sparsity must be in (0, 1) and the ramp in (0, 1]")
        if self.resumes and not Path(self.init).is_file():
            raise ValueError(
                f"--init {self.init}: no such gate artefact; give 'open', 'fit' or a "
                "file written by `sparseguard train-gates`"
            )

    @property
    def resumes(self) -> bool:
        return self.init not in ("open", "fit")

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
    gates = _start(lm, usable, cfg, prefix)
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


def _start(
    lm: LoadedModel, usable: list[torch.Tensor], cfg: GateTraining, prefix: Sequence[int]
) -> Gates:
    if cfg.resumes:
        return copy.deepcopy(load_gates(cfg.init)).requires_grad_(True)
    if cfg.init == "open":
        return Gates.for_layers(lm.layers, int(lm.model.config.hidden_size), cfg.rank)
    crops = [_crop(s, 0, cfg.seq_len, prefix) for s in usable[: cfg.fit_sequences]]
    stacked = [torch.stack(crops[i : i + cfg.batch]) for i in range(0, len(crops), cfg.batch)]
    log.info("fitting the gates on %d sequences", len(crops))
    return fit_gates(lm, stacked, cfg.rank, quantile=cfg.target)


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
        rows.append(_crop(seq, start, cfg.seq_len, prefix))
    return torch.stack(rows)


def _crop(seq: torch.Tensor, start: int, length: int, prefix: Sequence[int]) -> torch.Tensor:
    return torch.cat([torch.tensor(list(prefix), dtype=seq.dtype), seq[start:][:length]])


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
