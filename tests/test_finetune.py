"""Fine-tuning aids on tiny random Llamas: the L1-GRW term is the formula and raises the share
of tiny weights; the head KL is 0 for equal heads only; silence re-calibration reports a
channel forced silent and woken again; the loop, the model directory and the CLI's errors."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import torch

from services.cli.finetune import register
from services.config import Settings
from sparse_engine.compression.silence import SilenceRule
from sparse_engine.model.loader import LoadedModel, load_model
from sparse_engine.model.model_dir import MARKER_NAME
from sparse_engine.training.aids import (
    SilenceTracker,
    add_l1_grw,
    head_kl,
    head_kl_terms,
    l1_grw_gradient,
    mask_of,
)
from sparse_engine.training.finetune import (
    FinetuneConfig,
    finetune,
    mlp_weights,
    save_finetuned,
    training_windows,
    weight_of,
)
from tests.tiny import sample_texts, tiny_model


def windows(lm: LoadedModel, count: int, seq_len: int = 32) -> torch.Tensor:
    return training_windows(lm.tokenizer, sample_texts(16), seq_len, count)


# ---- L1-GRW -------------------------------------------------------------------------------


def test_l1_grw_gradient_is_the_formula() -> None:
    w = torch.tensor([-0.5, 0.0, 0.2, 3.0])
    got = l1_grw_gradient(w, lam=0.1, alpha=2.5)
    want = [-0.1 * math.exp(-1.25), 0.0, 0.1 * math.exp(-0.5), 0.1 * math.exp(-7.5)]
    assert got.tolist() == pytest.approx(want, rel=1e-6)


def test_add_l1_grw_adds_to_the_existing_gradient() -> None:
    param = torch.nn.Parameter(torch.tensor([0.1, -0.3]))
    param.grad = torch.tensor([1.0, 2.0])
    add_l1_grw([param], lam=0.5, alpha=2.5)
    want = [1.0 + 0.5 * math.exp(-0.25), 2.0 - 0.5 * math.exp(-0.75)]
    assert param.grad.tolist() == pytest.approx(want, rel=1e-6)


def test_l1_grw_raises_the_share_of_tiny_weights() -> None:
    shares = {}
    for alpha in (None, 2.5):
        lm = tiny_model()
        cfg = FinetuneConfig(
            steps=12, lr=1e-4, batch_size=1, seq_len=32, l1_alpha=alpha, l1_lambda=1.0
        )
        result = finetune(lm, windows(lm, 12), cfg)
        shares[alpha] = (result.tiny_share_before, result.tiny_share_after)
    assert shares[None][0] == shares[2.5][0]  # same seed, same start
    assert shares[2.5][1] > 2 * shares[None][1]


# ---- head KL ------------------------------------------------------------------------------


def test_head_kl_is_zero_for_equal_heads_and_positive_otherwise() -> None:
    probs = torch.softmax(torch.randn(1, 1, 5, 5), dim=-1).expand(2, 4, 5, 5)
    assert float(head_kl(probs)) == pytest.approx(0.0, abs=1e-7)
    different = torch.softmax(torch.randn(2, 4, 5, 5), dim=-1)
    assert float(head_kl(different)) > 1e-3


def test_head_kl_terms_of_a_model_with_equal_heads() -> None:
    lm = tiny_model()
    ids = windows(lm, 1)
    with torch.no_grad(), head_kl_terms(lm.model, lm.layers) as terms:
        lm.model(input_ids=ids)
    assert len(terms) == lm.num_layers and min(float(t) for t in terms) > 1e-4
    with torch.no_grad():
        for part in lm.layers:
            q, k = (
                weight_of(part.get("q")),
                weight_of(part.get("k")),
            )  # 4 query heads, 2 kv heads of 16
            q.copy_(q[:16].repeat(4, 1))
            k.copy_(k[:16].repeat(2, 1))
    with torch.no_grad(), head_kl_terms(lm.model, lm.layers) as terms:
        lm.model(input_ids=ids)
    assert max(float(t) for t in terms) == pytest.approx(0.0, abs=1e-6)
    assert lm.model.config._attn_implementation != "eager"  # restored on exit


def test_head_kl_term_reaches_q_and_k() -> None:
    lm = tiny_model()
    cfg = FinetuneConfig(steps=2, batch_size=1, seq_len=32, head_kl=1.0)
    result = finetune(lm, windows(lm, 2), cfg)
    assert "0.q" in result.trained and "1.k" in result.trained
    assert all(kl > 0 for kl in result.head_kl)


# ---- silence re-calibration ---------------------------------------------------------------


def test_recalibration_reports_a_channel_forced_silent_and_woken() -> None:
    lm = tiny_model()
    tracker = SilenceTracker(lm.layers, [w.unsqueeze(0) for w in windows(lm, 4)], SilenceRule())
    first = tracker.recalibrate(lm.model, 0)
    assert first.num_woke == first.num_quiet == 0
    gate = weight_of(lm.layers[0].get("gate"))
    saved = gate[7].clone()
    with torch.no_grad():
        gate[7] = 0.0  # silu(0) * up = 0 on every token
    quiet = tracker.recalibrate(lm.model, 1)
    assert quiet.quiet == {0: [7]} and quiet.woke == {}
    with torch.no_grad():
        gate[7] = saved
    woke = tracker.recalibrate(lm.model, 2)
    assert woke.woke == {0: [7]} and woke.quiet == {}


def test_mask_leaves_protected_layers_out() -> None:
    mask = mask_of({0: [3, 5], 1: [2]}, num_layers=2, rule=SilenceRule(protect_last=1))
    assert dict(mask.channels) == {0: (3, 5)}


def test_finetune_with_recalibration_records_drift_and_mask() -> None:
    lm = tiny_model()
    with torch.no_grad():
        weight_of(lm.layers[0].get("gate"))[9] = 0.0
    cfg = FinetuneConfig(steps=4, batch_size=1, seq_len=32, recalibrate_every=2, protect_last=1)
    result = finetune(lm, windows(lm, 4), cfg)
    assert [row["step"] for row in result.drift] == [0, 2, 4]
    assert 9 in result.final_mask["0"] and "1" not in result.final_mask
    assert len(result.losses) == 4 and all(math.isfinite(x) for x in result.losses)


# ---- data, output, CLI --------------------------------------------------------------------


def test_training_windows_repeat_when_the_data_runs_short() -> None:
    lm = tiny_model()
    got = training_windows(lm.tokenizer, sample_texts(4), 32, 200)
    assert got.shape == (200, 32)
    with pytest.raises(ValueError, match="at least 2 documents"):
        training_windows(lm.tokenizer, ["one document"], 32, 2)


def test_saved_directory_loads_back_and_is_never_overwritten(tmp_path: Path) -> None:
    lm = tiny_model()
    with torch.no_grad():
        mlp_weights(lm)[0].mul_(0.5)
    out = tmp_path / "ft"
    sha = save_finetuned(lm, out, {"steps": 1})
    assert (out / MARKER_NAME).is_file() and (out / "finetune-report.json").is_file()
    back = load_model(out)
    assert back.weights_sha256 == sha
    assert torch.equal(mlp_weights(back)[0], mlp_weights(lm)[0])
    with pytest.raises(ValueError, match="choose a new --out"):
        save_finetuned(lm, out, {})


def run_cli(argv: list[str], home: Path) -> int:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["finetune", *argv])
    return int(args.handler(args, Settings(home=home)))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps must be >= 1"),
        (["--l1-grw", "-1"], "--l1-grw ALPHA must be >= 0"),
        (["--lr", "0"], "--lr must be > 0"),
        (["--head-kl", "-0.5"], "--head-kl must be >= 0"),
    ],
)
def test_cli_rejects_bad_options(argv: list[str], message: str, tmp_path: Path) -> None:
    text = tmp_path / "data.txt"
    text.write_text("one\n\ntwo\n")
    with pytest.raises(ValueError, match=message):
        run_cli(["--data", str(text), *argv], tmp_path)


def test_cli_names_the_fix_for_a_missing_file_or_a_used_out_dir(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither a known corpus"):
        run_cli(["--data", str(tmp_path / "missing.txt")], tmp_path)
    used = tmp_path / "used"
    used.mkdir()
    (used / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="choose a new --out"):
        run_cli(["--data", "wiki", "--out", str(used)], tmp_path)
