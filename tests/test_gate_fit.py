"""The closed-form gate fit and the local-error diagnostic (`training.gate_fit`) on tiny random
decoders of the three families."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.cli import main
from sparse_engine.model.loader import LoadedModel
from sparse_engine.sparsity.gates import THRESHOLD, Gates, logit_sample, offset_for
from sparse_engine.training.gate_fit import fit_gates, local_error
from sparse_engine.training.train_gates import GateTraining, train_gates
from tests.tiny import sample_texts, tiny_model

FAMILIES = ["llama", "qwen2", "gemma3"]
CUT = float(torch.logit(torch.tensor(THRESHOLD)))


def _rows(lm: LoadedModel, count: int, start: int = 0) -> list[torch.Tensor]:
    texts = sample_texts(start + count)[start:]
    return [torch.tensor([lm.tokenizer(t)["input_ids"][:40]]) for t in texts]


def _at(lm: LoadedModel, gates: Gates, rows: list[torch.Tensor], share: float) -> float:
    sample = logit_sample(lm.layers, gates, lambda: [lm.model(input_ids=r) for r in rows])
    return offset_for(sample, share)


@pytest.mark.parametrize("family", FAMILIES)
def test_fitted_gates_predict_the_small_channels(family: str) -> None:
    lm = tiny_model(family)
    fit_rows, held = _rows(lm, 8), _rows(lm, 4, start=8)
    fitted = fit_gates(lm, fit_rows, rank=8, quantile=0.5)
    torch.manual_seed(0)
    guessed = Gates.for_layers(lm.layers, int(lm.model.config.hidden_size), 8)
    for up in guessed.up:
        torch.nn.init.normal_(up, std=1.0)
    found = {
        name: local_error(lm, gates, _at(lm, gates, held, 0.5), held)
        for name, gates in (("fitted", fitted), ("guessed", guessed))
    }
    for fit, guess in zip(found["fitted"], found["guessed"], strict=True):
        assert abs(fit.sparsity - 0.5) < 0.1 and abs(guess.sparsity - 0.5) < 0.1
        assert fit.gates < guess.gates / 2  # far better than gates that know nothing
        assert fit.magnitude <= fit.gates  # and short of closing by magnitude
    # at offset 0 a fitted gate opens where the predicted magnitude passes the quantile
    sparsity = [e.sparsity for e in local_error(lm, fitted, 0.0, fit_rows)]
    assert all(abs(s - 0.5) < 0.2 for s in sparsity)


def test_the_fit_streams_its_batches() -> None:
    lm = tiny_model()
    rows = _rows(lm, 4)
    width = min(r.shape[1] for r in rows)
    rows = [r[:, :width] for r in rows]
    one_by_one = fit_gates(lm, rows, rank=4)
    together = fit_gates(lm, [torch.cat(rows)], rank=4)
    x = torch.randn(64, int(lm.model.config.hidden_size))
    for layer in range(one_by_one.num_layers):
        # the same moments; only the thinned magnitude sample behind the quantile differs
        a, b = one_by_one.logits(layer, x), together.logits(layer, x)
        assert ((a > CUT) == (b > CUT)).float().mean() > 0.98  # the same open gates
        assert torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1] > 0.999
    with pytest.raises(ValueError, match="no tokens"):
        fit_gates(lm, [], rank=4)


def test_local_error_of_all_open_and_all_closed() -> None:
    lm = tiny_model("qwen2")
    rows, gates = _rows(lm, 3), fit_gates(lm, _rows(lm, 3), rank=4)
    for layer in local_error(lm, gates, 1e4, rows):
        assert layer.sparsity == 0.0 and layer.gates == 0.0
    for layer in local_error(lm, gates, -1e4, rows):
        assert layer.sparsity == 1.0 and layer.gates == pytest.approx(1.0, rel=1e-4)
        assert layer.magnitude > 0.9  # all but the largest activation closed
    with pytest.raises(ValueError, match="--init"):
        GateTraining(init="zeros").check()


def test_training_starts_from_the_fit_or_an_artefact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lm = tiny_model()
    sequences = [r[0] for r in _rows(lm, 6)]
    held = _rows(lm, 1, start=6)[0][0]
    base = GateTraining(steps=0, batch=2, seq_len=24, rank=4, target=0.5, init="fit")
    fitted = train_gates(lm, sequences, held, base)
    assert fitted.curve == []  # no step taken: the fit is the result
    crops = [s[:24].unsqueeze(0) for s in sequences]
    again = fit_gates(lm, [torch.cat(crops[i : i + 2]) for i in (0, 2, 4)], 4, quantile=0.5)
    for a, b in zip(fitted.gates.parameters(), again.parameters(), strict=True):
        torch.testing.assert_close(a, b)
    fitted.gates.version = "tiny-fit"
    path = tmp_path / "tiny-fit.safetensors"
    fitted.gates.save(path, {})
    same = train_gates(lm, sequences, held, GateTraining(steps=0, init=str(path), seq_len=24))
    assert all(
        torch.equal(a, b)
        for a, b in zip(same.gates.parameters(), fitted.gates.parameters(), strict=True)
    )
    on = train_gates(lm, sequences, held, GateTraining(steps=3, init=str(path), seq_len=24))
    assert len(on.curve) == 3 and on.gates.rank == 4  # went on from the artefact's gates
    assert not all(
        torch.equal(a, b)
        for a, b in zip(on.gates.parameters(), fitted.gates.parameters(), strict=True)
    )
    with pytest.raises(ValueError, match="--steps"):
        GateTraining(steps=0).check()  # an open start needs training
    assert main(["train-gates", "--init", str(path), "--rank", "8"]) == 2
    assert "--rank does not apply" in capsys.readouterr().err
