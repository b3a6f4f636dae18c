"""Learned gates (`sparsity.gates`, `training.train_gates`) on tiny random decoders: the gate
rule, the straight-through mask, training, the artefact, calibration and serving."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from services.cli import main
from services.config import Settings
from sparse_engine.calibration.pipeline import CalibrationConfig, calibrate, prepare_data
from sparse_engine.calibration.store import CalibrationStore
from sparse_engine.evaluation.perplexity import perplexity
from sparse_engine.model.loader import LoadedModel
from sparse_engine.runtime import kernels
from sparse_engine.runtime.generation import GenerationRequest
from sparse_engine.runtime.scoring import Probe, score_many
from sparse_engine.sparsity import gates as gating
from sparse_engine.sparsity.gates import Gates, confidence, gated, load_gates, offset_for
from sparse_engine.sparsity.plan import Level, SparsityPlan
from sparse_engine.training.train_gates import GateTraining, train_gates
from tests.tiny import sample_texts, tiny_engine, tiny_model

FAMILIES = ["llama", "qwen2", "gemma3"]


def _gates(lm: LoadedModel, seed: int = 1) -> Gates:
    torch.manual_seed(seed)
    gates = Gates.for_layers(lm.layers, int(lm.model.config.hidden_size), rank=8)
    for up in gates.up:
        torch.nn.init.normal_(up, std=1.0)
    return gates.requires_grad_(False)


def _ids(lm: LoadedModel, n: int = 48) -> torch.Tensor:
    return torch.tensor([lm.tokenizer(sample_texts(1)[0])["input_ids"][:n]])


@pytest.mark.parametrize("family", FAMILIES)
def test_open_gates_are_the_dense_model_and_closed_gates_remove_the_mlp(family: str) -> None:
    lm = tiny_model(family)
    gates, ids = _gates(lm), _ids(lm)
    with torch.inference_mode():
        dense = lm.model(input_ids=ids).logits
        with gated(lm.layers, gates, offset=1e4):
            opened = lm.model(input_ids=ids).logits
        with gated(lm.layers, gates, offset=-1e4):
            closed = lm.model(input_ids=ids).logits
    assert torch.equal(opened, dense)
    assert not torch.allclose(closed, dense, atol=1e-3)
    shut = SparsityPlan(gates=gates, gate_offset=-1e4)
    inputs = ids.shape[-1] - 1  # a served plan leaves position 0 open (`sparsity.sink`)
    assert perplexity(lm.model, lm.layers, ids[0], shut).sparsity == pytest.approx(
        (inputs - 1) / inputs
    )


def test_the_mask_is_hard_forward_and_the_sigmoid_backward() -> None:
    lm = tiny_model()
    gates, ids = _gates(lm).requires_grad_(True), _ids(lm)
    with torch.inference_mode(), gated(lm.layers, gates):
        hard = lm.model(input_ids=ids).logits
    actives: list[torch.Tensor] = []
    with gated(lm.layers, gates, straight_through=True, actives=actives):
        soft = lm.model(input_ids=ids).logits
    assert torch.allclose(soft, hard, atol=1e-5)  # the forward value is the hard decision
    soft.square().mean().backward()
    assert all(b.grad is not None and b.grad.abs().sum() > 0 for b in gates.bias)
    assert 0.0 < float(torch.stack(actives).detach().mean()) < 1.0


def test_gate_confidence_is_the_distance_from_the_threshold() -> None:
    decided = torch.tensor([[0.0, 1.0, 0.0, 1.0]])
    undecided = torch.full((1, 4), gating.THRESHOLD)
    assert confidence(decided).tolist() == [1.0]
    assert confidence(undecided).tolist() == [0.0]
    half = torch.tensor([[0.05, 0.55]])  # halfway on each side
    assert confidence(half).item() == pytest.approx(0.5)


def test_offset_puts_the_target_share_under_the_threshold() -> None:
    logits = torch.randn(10_000, generator=torch.Generator().manual_seed(0))
    for target in (0.1, 0.45, 0.8):
        shifted = torch.sigmoid(logits + offset_for(logits, target))
        assert float((shifted <= gating.THRESHOLD).double().mean()) == pytest.approx(
            target, abs=1e-3
        )
    with pytest.raises(ValueError, match="target sparsity"):
        offset_for(logits, 1.0)


def test_training_closes_channels_and_leaves_the_model_alone() -> None:
    lm = tiny_model()
    before = {k: v.clone() for k, v in lm.model.state_dict().items()}
    sequences = [t[0] for t in (_ids(lm, 64), _ids(lm, 80))]
    cfg = GateTraining(steps=40, batch=2, seq_len=32, rank=8, lr=1e-2, target=0.5, eval_every=20)
    seen: list[int] = []
    trained = train_gates(
        lm, sequences, _ids(lm, 64)[0], cfg, progress=lambda p: seen.append(p.step)
    )
    assert seen == list(range(1, 41))
    assert trained.curve[-1].sparsity > 0.3  # the hinge pulled it toward 0.5
    judged = [p for p in trained.curve if p.heldout_ppl is not None]
    assert [p.step for p in judged] == [20, 40] and (judged[-1].heldout_sparsity or 0) > 0.3
    assert all(torch.equal(v, lm.model.state_dict()[k]) for k, v in before.items())
    assert all(p.requires_grad for p in lm.model.parameters())  # left as it found them
    with pytest.raises(ValueError, match="seq-len"):
        train_gates(lm, sequences, _ids(lm)[0], replace(cfg, seq_len=500))


def test_the_artefact_round_trips_and_is_pinned(tmp_path: Path) -> None:
    lm = tiny_model()
    gates = _gates(lm)
    gates.version = "tiny-gates-1"
    path = tmp_path / "tiny-gates-1.safetensors"
    digest = gates.save(path, {"model_id": lm.model_id})
    loaded = load_gates(str(path), digest)
    assert loaded.version == "tiny-gates-1" and loaded.rank == 8
    assert all(
        torch.equal(a, b) for a, b in zip(gates.parameters(), loaded.parameters(), strict=True)
    )
    assert '"sha256"' in path.with_suffix(".json").read_text()
    with pytest.raises(ValueError, match="pinned sha256"):
        load_gates(str(path), "0" * 64)
    with pytest.raises(FileNotFoundError, match="train-gates"):
        load_gates(str(tmp_path / "missing.safetensors"))


def test_calibrating_gates_meets_the_budget_and_serves(tmp_path: Path) -> None:
    lm = tiny_model()
    gates = _gates(lm)
    gates.version = "tiny-gates-2"
    path = tmp_path / "tiny-gates-2.safetensors"
    gates.save(path, {})
    cfg = CalibrationConfig(
        samples=4, seq_len=64, heldout_tokens=256, sparsifier="gates", gates_path=str(path)
    )
    data = prepare_data(lm.tokenizer, sample_texts(12), cfg, "tiny")
    (cal,) = calibrate(lm, data, [Level.AGGRESSIVE], cfg)
    assert cal.sparsifier == "gates" and cal.thresholds == {} and cal.gates is not None
    assert cal.perplexity_change_pct <= cal.budget_pct and cal.realised_sparsity > 0.0
    stored = CalibrationStore(tmp_path / "cals").save(cal)
    plan = CalibrationStore(tmp_path / "cals").load(stored.version).plan()
    assert plan.gates is not None and plan.gate_offset == cal.gates["offset"]
    without = replace(cfg, gates_path=None)
    with pytest.raises(ValueError, match="--gates FILE"):
        calibrate(lm, data, [Level.AGGRESSIVE], without)


def test_the_engine_serves_a_gate_plan_on_the_reference_path() -> None:
    engine = tiny_engine(cache=False)
    engine.enable_fast_path("float32", kernels.load(), max_len=256)
    gates = _gates(engine.lm)
    gates.version = "tiny-gates-3"
    plan = SparsityPlan(Level.BALANCED, gates=gates, gate_offset=0.5, calibration_version="g")
    engine.install(plan)
    assert engine.fast is not None and not engine.fast.supports(plan, 10)
    request = GenerationRequest(prompt="The quick brown fox", max_new_tokens=6)
    stats = engine.generate(request, Level.BALANCED).result()
    dense = engine.generate(request, Level.DENSE).result()
    assert stats.signals is not None and dense.signals is not None
    assert 0.0 < stats.signals.sparsity_ratio < 1.0 and dense.signals.sparsity_ratio == 0.0
    # the gate plan's confidence is read from the gate values, not the kept magnitude
    ids = torch.tensor([engine.encode_text("The quick brown fox")])
    found: list[torch.Tensor] = []
    with torch.inference_mode():
        hook = (
            engine.lm.layers[0]
            .get("mlp")
            .register_forward_pre_hook(
                lambda m, a: found.append(confidence(torch.sigmoid(gates.logits(0, a[0]) + 0.5)))
            )
        )
        with gated(engine.lm.layers, gates, 0.5):
            engine.lm.model(input_ids=ids)
        hook.remove()
    assert 0.0 < float(found[0].mean()) < 1.0
    assert stats.signals.gate_confidence != pytest.approx(dense.signals.gate_confidence)


def test_batched_probes_under_gates_match_each_alone() -> None:
    engine = tiny_engine(cache=False)
    gates = _gates(engine.lm)
    engine.install(SparsityPlan(Level.BALANCED, gates=gates, calibration_version="g"))
    answers = ["Four, of course.", "It is sunny and warm today, very warm"]
    probes = [
        Probe([{"role": "user", "content": f"Question {i}?"}], engine.encode_text(a), True, a)
        for i, a in enumerate(answers)
    ]
    alone = [score_many(engine, [p], Level.BALANCED)[0] for p in probes]
    together = score_many(engine, probes, Level.BALANCED)
    for want, got in zip(alone, together, strict=True):
        assert want.signals is not None and got.signals is not None
        assert got.signals.sparsity_ratio == pytest.approx(want.signals.sparsity_ratio, abs=1e-6)
        assert got.signals.gate_confidence == pytest.approx(want.signals.gate_confidence, abs=1e-5)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps"),
        (["--init", "missing.safetensors"], "no such gate artefact"),
        (["--target-sparsity", "1.5"], "--target-sparsity"),
        (["--level", "dense"], "dense level"),
    ],
)
def test_train_gates_names_the_fix_for_bad_options(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train-gates", *argv]) == 2
    assert message in capsys.readouterr().err


def test_calibrate_asks_for_the_gate_artefact(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["calibrate", "--sparsifier", "gates"]) == 2
    assert "--gates FILE" in capsys.readouterr().err


def test_calibrate_per_source_asks_for_a_mixed_corpus(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["calibrate", "--per-source", "--data", "wiki"]) == 2
    assert "--data wiki+c4+technical" in capsys.readouterr().err
    # The default: a bound on each part of the mixed default corpus, and of any mixed --data;
    # a one-part corpus has one bound (pooled), and the setting turns it off.
    engine = Settings().engine
    assert engine.calibration_corpus == "wiki+c4+technical"
    assert engine.per_source_for(engine.calibration_corpus) and engine.per_source_for("wiki+c4")
    assert not engine.per_source_for("wiki")
    monkeypatch.setenv("SPARSEGUARD_ENGINE__CALIBRATION_PER_SOURCE", "false")
    assert not Settings().engine.per_source_for("wiki+c4+technical")
    # Asked for in the settings with a one-part corpus: refused at start, naming the fix.
    monkeypatch.setenv("SPARSEGUARD_ENGINE__CALIBRATION_CORPUS", "wiki")
    monkeypatch.setenv("SPARSEGUARD_ENGINE__CALIBRATION_PER_SOURCE", "true")
    with pytest.raises(ValidationError, match="has one part"):
        Settings()
