"""Each signal's definition, checked on hand-made tensors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sparse_engine.sparsity import signals
from sparse_engine.sparsity.recorder import SignalRecorder


def test_kept_magnitude_share_is_kept_over_total() -> None:
    x = torch.tensor([[1.0, -2.0, 3.0, -4.0]])
    kept = torch.tensor([[False, False, True, True]])
    assert signals.kept_magnitude_share(x.abs(), kept).item() == pytest.approx(7 / 10)


def test_kept_share_of_all_zero_token_is_one() -> None:
    x = torch.zeros(1, 3)
    assert signals.kept_magnitude_share(x, x > 0).item() == 1.0


def test_coefficient_of_variation() -> None:
    assert signals.coefficient_of_variation_pct([0.5, 0.5, 0.5]) == 0.0
    assert signals.coefficient_of_variation_pct([0.4, 0.6]) == pytest.approx(20.0)
    assert signals.coefficient_of_variation_pct([0.3]) == 0.0


def test_entropy_bits_per_char() -> None:
    assert signals.entropy_bits_per_char("aaaa") == 0.0
    assert signals.entropy_bits_per_char("abab") == pytest.approx(1.0)
    assert signals.entropy_bits_per_char("abcd") == pytest.approx(2.0)
    assert signals.entropy_bits_per_char("") == 0.0


def test_silence_rate_counts_channels_with_mean_below_threshold() -> None:
    mean_magnitude = torch.tensor([0.001, 0.5, 0.009, 0.01])
    assert signals.silence_rate(mean_magnitude, 0.01) == pytest.approx(2 / 4)
    assert signals.silence_rate(torch.empty(0), 0.01) == 0.0


def test_token_kl_zero_for_equal_and_known_value() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    assert signals.token_kl(logits, logits).item() == pytest.approx(0.0, abs=1e-7)
    p = torch.tensor([0.5, 0.5])
    q = torch.tensor([0.9, 0.1])
    expected = float((p * (p / q).log()).sum())
    got = signals.token_kl(p.log().unsqueeze(0), q.log().unsqueeze(0)).item()
    assert got == pytest.approx(expected, rel=1e-5)


def test_normalised_entropy_uniform_is_one_and_peaked_is_low() -> None:
    assert signals.normalised_entropy(torch.ones(8)) == pytest.approx(1.0)
    assert signals.normalised_entropy(torch.tensor([1.0, 0, 0, 0])) == pytest.approx(0.0)


@given(st.lists(st.floats(0.01, 1.0), min_size=2, max_size=30))
def test_cv_is_scale_invariant(values: list[float]) -> None:
    scaled = [3 * v for v in values]
    assert signals.coefficient_of_variation_pct(scaled) == pytest.approx(
        signals.coefficient_of_variation_pct(values), rel=1e-6, abs=1e-9
    )


def test_recorder_sparsity_is_size_weighted_and_steps_are_tracked() -> None:
    rec = SignalRecorder(num_layers=2)
    rec.begin_step()
    x = torch.ones(1, 4, 10)
    rec.observe_sparsified(0, x, torch.arange(10).expand(1, 4, 10) >= 5)  # 50% zeroed, 40 values
    rec.observe_sparsified(1, torch.ones(1, 4, 30), torch.ones(1, 4, 30, dtype=torch.bool))
    rec.end_step()
    for zeros in (2, 4):
        rec.begin_step()
        kept = torch.arange(10).expand(1, 1, 10) >= zeros
        rec.observe_sparsified(0, torch.ones(1, 1, 10), kept)
        rec.end_step()
    s = rec.summary()
    assert s.sparsity_per_layer[0] == pytest.approx((20 + 2 + 4) / 60)
    assert s.sparsity_per_layer[1] == 0.0
    assert s.sparsity_ratio == pytest.approx(26 / 180)
    assert s.step_sparsity == pytest.approx([20 / 160, 0.2, 0.4])
    # decode steps only: CV of [0.2, 0.4]
    assert s.activation_stability_pct == pytest.approx(100 * 0.1 / 0.3)
    assert s.gate_confidence == pytest.approx((0.5 * 4 + 0.8 + 0.6) / 6 / 2 + 0.5)


def test_recorder_silence_rate_per_layer() -> None:
    rec = SignalRecorder(num_layers=1, silence_thresholds=[0.01])
    x = torch.tensor([[[0.0, 1.0, 0.001, 0.005]] * 20])
    x[0, 0, 3] = 1.0  # one loud token lifts channel 3's mean above the threshold
    rec.observe_channels(0, x[:, :10])
    rec.observe_channels(0, x[:, 10:])
    assert rec.summary().silence_rate_per_layer == [pytest.approx(2 / 4)]
    assert math.isfinite(rec.summary().gate_entropy)


def test_prompt_category_tells_code_from_text_by_its_layout() -> None:
    code = "What does this code do?\n\ndef f(x):\n    y = x * 2\n    return y\n\nprint(f(3))"
    assert signals.prompt_category(code) == signals.CODE
    assert signals.prompt_category("Tell me about Paris (France).") == signals.TEXT
    prose = "A first line.\nA second one.\nA third one.\nA fourth, with no symbols at all."
    assert signals.prompt_category(prose) == signals.TEXT
    cyrillic = "\n".join(["функция(x) { return x; }"] * 5)  # laid out as code, not ASCII
    assert signals.prompt_category(cyrillic) == signals.TEXT
    assert signals.prompt_category("") == signals.TEXT


def test_prompt_category_tells_machine_data_by_its_digits_or_its_records() -> None:
    numbers = "[" + ", ".join(f"{i % 9 - 4}.0{i % 5}" for i in range(40)) + "]"
    assert signals.prompt_category(numbers) == signals.DATA  # a number table: half digits
    rows = "\n".join(f"MSFT,Jan 1 20{i:02},{30 + i}.5" for i in range(6))
    csv = f"What does this data show?\n\nsymbol,date,price\n{rows}"
    assert signals.prompt_category(csv) == signals.DATA  # records: same commas on each line
    short = "What does this data show?\n\nsymbol,date,price\nMSFT,Jan 1 2000,39.81\nIBM,Feb 1"
    assert signals.prompt_category(short) == signals.TEXT  # three records are not enough
    names = "\n".join(f"{n},{n.lower()}@example.org,Berlin" for n in ("Ann", "Bob", "Cy", "Di"))
    assert signals.prompt_category(names) == signals.TEXT  # records without digits
    sentences = "I came, I saw, I won in 1947.\n" * 2 + "Then, in 1950, I left.\nAnd, well, 1."
    assert signals.prompt_category(sentences) == signals.TEXT  # commas on too few lines
