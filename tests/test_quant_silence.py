"""Quantisation against silence on tiny random models: weights come back bit for bit, int8 is
the fast path's own rule, the lift is exact without rounding and acts only through rounding,
and the survey and the CLI's input checks behave."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import torch

from services.cli.quant_study import check_args, level_plans, register
from sparse_engine.calibration.allocation import thresholds_for, uniform_targets
from sparse_engine.calibration.stats import collect_stats
from sparse_engine.calibration.store import CalibrationStore
from sparse_engine.compression.quant_silence import (
    Q4_MAX,
    QUANTISERS,
    damage,
    fingerprint,
    fp8_rows,
    int8_fast_path,
    q4_blocks,
    quantise_group,
    quantised,
    weight,
)
from sparse_engine.compression.quant_survey import SurveyInputs, compare, quietest, survey
from sparse_engine.model.loader import LoadedModel
from sparse_engine.runtime.fast_weights import Family, extract_layer
from sparse_engine.sparsity.plan import Level, SparsityPlan
from tests.tiny import sample_texts, tiny_model

ROLES = ("q", "k", "v", "o", "gate", "up", "down")
DEAD = (0, 7)  # (layer, MLP channel) made silent: its gate row is zero, so silu(0) * up = 0


def weights_of(lm: LoadedModel) -> dict[tuple[int, str], torch.Tensor]:
    return {(p.index, r): weight(p, r).clone() for p in lm.layers for r in ROLES}


@pytest.mark.parametrize("kind", ["int8", "q4", "fp8"])
def test_weights_change_inside_and_come_back_bit_for_bit(kind: str) -> None:
    lm = tiny_model("qwen2")
    before = weights_of(lm)
    with pytest.raises(RuntimeError), quantised(lm.layers, QUANTISERS[kind]):
        changed = [k for k, w in weights_of(lm).items() if not torch.equal(w, before[k])]
        assert len(changed) == len(before)
        raise RuntimeError("an error inside the block restores the weights too")
    assert all(torch.equal(w, before[k]) for k, w in weights_of(lm).items())


def test_int8_is_the_fast_paths_rule_fused_as_it_fuses() -> None:
    lm = tiny_model("llama")
    family = Family.of(lm.model.config)
    blocks = [extract_layer(layer, torch.int8, family) for layer in lm.model.model.layers]
    with quantised(lm.layers, QUANTISERS["int8"]):
        for part, block in zip(lm.layers, blocks, strict=True):
            for matrix in (block.qkv, block.o, block.gate_up, block.down):
                rows = matrix.float_rows()
                for role, a, b in matrix.parts:
                    assert torch.equal(weight(part, role), rows[:, a:b].T)
    q = weight(lm.layers[0], "q")
    alone = int8_fast_path({"q": q})["q"]
    assert not torch.equal(alone, blocks[0].qkv.float_rows()[:, : q.shape[0]].T)


def test_lift_without_rounding_is_exact() -> None:
    torch.manual_seed(1)
    group = {"down": torch.randn(16, 48), "o": torch.randn(16, 48) * 1e-3}
    lift = {"down": [0, 5, 47], "o": [3]}
    back = quantise_group(group, QUANTISERS["float32"], lift, 1.5)
    assert all(torch.equal(back[r], group[r]) for r in group)
    lm = tiny_model("llama")
    before = fingerprint(lm.layers)
    with quantised(lm.layers, QUANTISERS["float32"], {(0, "mlp"): [1, 2], (1, "attn"): [4]}):
        assert fingerprint(lm.layers) == before


def step_row(value: float) -> torch.Tensor:
    """One 4-bit block of 32 columns: column 0 holds the block's maximum 1.0, column 5 holds
    `value` (a multiple of the step 1/7)."""
    w = torch.full((2, 32), 0.5)
    w[:, 0], w[:, 5] = 1.0, value / Q4_MAX
    return w


def test_q4_lift_keeps_weights_between_a_third_and_half_a_step_only() -> None:
    for value, kept_plain, kept_lifted in ((0.4, False, True), (0.3, False, False)):
        group = {"down": step_row(value)}
        plain = quantise_group(group, QUANTISERS["q4"], {})["down"][:, 5]
        lifted = quantise_group(group, QUANTISERS["q4"], {"down": [5]}, 1.5)["down"][:, 5]
        assert bool((plain != 0).all()) is kept_plain
        assert bool((lifted != 0).all()) is kept_lifted
    kept = quantise_group({"down": step_row(0.4)}, QUANTISERS["q4"], {"down": [5]}, 1.5)
    assert torch.allclose(kept["down"][:, 5], torch.full((2,), 1 / 1.5 / Q4_MAX))


def test_a_lifted_column_holding_its_blocks_maximum_coarsens_the_block() -> None:
    w = step_row(0.4)
    w[:, 5] = 0.9  # lifted to 1.35: the new block maximum, so every step grows by 1.35x
    plain = quantise_group({"down": w}, QUANTISERS["q4"], {})["down"]
    lifted = quantise_group({"down": w}, QUANTISERS["q4"], {"down": [5]}, 1.5)["down"]
    others = [c for c in range(32) if c != 5]
    assert (lifted[:, others] - w[:, others]).abs().sum() > (
        plain[:, others] - w[:, others]
    ).abs().sum()


def test_int8_per_input_scale_makes_the_lift_change_no_zero() -> None:
    torch.manual_seed(2)
    w = torch.randn(64, 32) * torch.logspace(-4, 0, 32)
    plain = quantise_group({"down": w}, QUANTISERS["int8"], {})["down"]
    lifted = quantise_group({"down": w}, QUANTISERS["int8"], {"down": list(range(16))})["down"]
    assert torch.equal(plain == 0, lifted == 0)
    assert torch.allclose(plain, lifted, rtol=1e-6, atol=0)


def test_fp8_and_q4_round_trip_within_their_steps() -> None:
    torch.manual_seed(3)
    w = torch.randn(8, 70)
    assert (q4_blocks(w) - w).abs().max() <= w.abs().max() / Q4_MAX / 2 + 1e-6
    assert torch.allclose(fp8_rows(w), w, rtol=2**-3, atol=0)
    assert q4_blocks(w).shape == w.shape


def test_damage_counts_zeroed_weights_of_the_listed_channels() -> None:
    lm = tiny_model("llama")
    down = weight(lm.layers[0], "down")
    with torch.no_grad():
        down[:, 3] = 0.0
        block_max = down[:, :32].abs().amax(1)  # channel 3's block of 32 input columns
        down[:, 3] = 0.4 * block_max / Q4_MAX  # below half a 4-bit step, above a third
        down[:, 3][::Q4_MAX] = 0.0  # float32 zeros are not counted
    channels = {(0, "mlp"): [3]}
    with quantised(lm.layers, QUANTISERS["q4"]) as originals:
        plain = damage(lm.layers, originals, channels)
    with quantised(lm.layers, QUANTISERS["q4"], channels) as originals:
        lifted = damage(lm.layers, originals, channels)
    assert plain.weights == lifted.weights == 64 - len(range(0, 64, Q4_MAX))
    assert plain.zeroed_share == 1.0 and plain.relative_error == pytest.approx(1.0)
    assert lifted.zeroed_share == 0.0 and lifted.relative_error < plain.relative_error


def test_compare_counts_woken_and_quieted_channels() -> None:
    reference = {(0, "mlp"): [1, 2, 3], (1, "attn"): [4]}
    other = {(0, "mlp"): [2, 3, 9], (1, "attn"): []}
    change = compare(reference, other)
    assert (change.silent, change.woke, change.quieted) == (3, 2, 1)
    assert change.jaccard == pytest.approx(2 / 5)
    assert compare({}, {}).jaccard == 1.0


def test_quietest_takes_the_lowest_mean_channels_of_each_site() -> None:
    means = {(0, "mlp"): torch.tensor([0.5, 0.1, 0.3, 0.05]), (0, "attn"): torch.tensor([1.0, 2.0])}
    assert quietest(means, 0.5) == {(0, "mlp"): [1, 3], (0, "attn"): [0]}
    assert quietest(means, 0.0) == {(0, "mlp"): [], (0, "attn"): []}


def planted() -> tuple[LoadedModel, SurveyInputs]:
    lm = tiny_model("llama")
    layer, channel = DEAD
    with torch.no_grad():
        weight(lm.layers[layer], "gate")[channel] = 0.0
    ids = [lm.tokenizer(t)["input_ids"][:64] for t in sample_texts(6)]
    batches = [torch.tensor([i]) for i in ids[:4]]
    tokens = torch.tensor(ids[4] + ids[5])
    stats = collect_stats(lm.model, lm.layers, batches, ("down",))
    balanced = SparsityPlan(
        Level.BALANCED, thresholds_for(stats, uniform_targets(stats, ("down",), 0.5))
    )
    return lm, SurveyInputs(batches, tokens, {"dense": SparsityPlan(), "balanced": balanced})


def test_survey_measures_every_variant_against_float32() -> None:
    lm, inputs = planted()
    before = weights_of(lm)
    results = survey(lm, inputs, ["q4", "int8"])
    assert [r.name for r in results] == [
        "float32",
        "float32+lift",
        "q4",
        "q4+lift",
        "int8",
        "int8+lift",
    ]
    base, lifted = results[0], results[1]
    assert base.silent.jaccard == 1.0 and base.silent.silent >= 1
    assert base.levels["dense"].change_pct == 0.0 and base.damage.error_sq == 0.0
    assert lifted.same_as == "float32"
    assert 0.3 < base.levels["balanced"].sparsity < 0.7
    q4, q4_lift = results[2], results[3]
    assert q4.damage.all_relative_error > 0.01 and q4.levels["dense"].change_pct != 0.0
    assert q4.damage.weights == q4_lift.damage.weights > 0  # the planted channel's column
    assert q4_lift.same_as is None
    wider = survey(lm, dataclasses.replace(inputs, quiet_share=0.05), ["q4"])
    assert wider[2].damage.weights > q4.damage.weights
    assert all(torch.equal(w, before[k]) for k, w in weights_of(lm).items())


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["quant-silence", *argv])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--samples", "0"], "--samples must be at least 1"),
        (["--seq-len", "8"], "--seq-len must be at least 32"),
        (["--eval-tokens", "1"], "--eval-tokens must be at least 2"),
        (["--weights", "int4"], "--weights takes a comma-separated list of: float32, int8"),
        (["--levels", "fast"], "unknown level 'fast'"),
        (["--lift", "0"], "--lift must be a positive factor"),
        (["--lift-quietest", "5"], "--lift-quietest is a share of channels between 0 and 1"),
    ],
)
def test_cli_input_errors_say_what_to_change(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_args(parse(argv))


def test_a_level_not_calibrated_says_how_to_calibrate(tmp_path: Path) -> None:
    cals = CalibrationStore(tmp_path)
    with pytest.raises(LookupError, match="sparseguard calibrate --level balanced"):
        level_plans(cals, "sha", "dense,balanced")
    assert list(level_plans(cals, "sha", None)) == ["dense"]
