"""Weight-informed sparsity as a fold (`compression.weighting`): on tiny Llama, Qwen2 and
Gemma 3 models the folded copy computes the same logits, its down projection reads each
input scaled by its weight column's norm (so a magnitude threshold ranks |x| * norm), and
`sparseguard model fold` writes a directory that loads back, keeps the source's notices, and
is made once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.cli import main
from sparse_engine.compression.weighting import folded_copy, save_folded
from sparse_engine.model.loader import LoadedModel, load_model
from sparse_engine.model.surgery import mlp_linear
from tests.test_compression import logits
from tests.tiny import tiny_model


def down_inputs(lm: LoadedModel, text: str) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    handles = [
        mlp_linear(part, "down").register_forward_pre_hook(lambda _, a: seen.append(a[0][0]))
        for part in lm.layers
    ]
    try:
        logits(lm, text)
    finally:
        for handle in handles:
            handle.remove()
    return seen


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_the_fold_keeps_the_function_and_scales_each_down_input_by_its_column_norm(
    family: str,
) -> None:
    lm = tiny_model(family)
    folded = folded_copy(lm)
    text = "Sparse activations skip work."
    assert torch.allclose(logits(folded, text), logits(lm, text), atol=1e-4)
    for part, before, after in zip(
        lm.layers, down_inputs(lm, text), down_inputs(folded, text), strict=True
    ):
        norms = mlp_linear(part, "down").weight.detach().norm(dim=0)
        assert torch.allclose(after, before * norms, atol=1e-5)
    for part in folded.layers:
        unit = mlp_linear(part, "down").weight.detach().norm(dim=0)
        assert torch.allclose(unit, torch.ones_like(unit), atol=1e-5)
    assert mlp_linear(lm.layers[0], "down").weight.norm(dim=0).std() > 0  # not folded already


def test_fold_cli_writes_a_verified_copy_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPARSEGUARD_HOME", str(tmp_path))
    lm = tiny_model("gemma3")
    source = tmp_path / "tiny"
    lm.model.save_pretrained(source)
    lm.tokenizer.save_pretrained(source)
    (source / "TERMS.html").write_text("terms of use")
    out = tmp_path / "models" / "tiny-wina"
    assert main(["model", "fold", str(source)]) == 0
    assert "greedy tokens equal on 8 prompts" in capsys.readouterr().out
    loaded = load_model(out)
    assert torch.allclose(logits(loaded), logits(load_model(source)), atol=1e-4)
    assert (out / "TERMS.html").read_text() == "terms of use"
    assert main(["model", "fold", str(source)]) == 0
    assert "folded already" in capsys.readouterr().out
    again = save_folded(load_model(source), None, tmp_path / "again")
    assert again.weights_sha256 == loaded.weights_sha256  # the same weights, byte for byte
