"""The trust readout (residual stream at a few layers, per-head attention share on the prompt
and entropy) is the same whichever pass reads it: generated on the reference path, on the fast
path with the compiled kernels or its PyTorch fallback, or teacher-forced in one pass as proxy
mode scores an answer, on tiny Llama, Qwen2 and Gemma 3 (whose sliding window is shorter than
the prompt), dense and sparse."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from sparse_engine.runtime import kernels
from sparse_engine.runtime.engine import Engine, GenerationRequest
from sparse_engine.runtime.scoring import score_tokens
from sparse_engine.sparsity.plan import Level
from sparse_engine.sparsity.readout import AnswerReadout, Readout, read_layers
from tests.tiny import tiny_engine

MESSAGES = [{"role": "user", "content": "Passage: the robot sorted red bolts. Who sorted them?"}]


@pytest.fixture(scope="module")
def native() -> Any:
    module = kernels.load()
    assert module is not None, "the compiled kernels did not build: see the warning logged"
    return module


def _generate(engine: Engine, level: Level) -> tuple[list[int], AnswerReadout]:
    request = GenerationRequest(messages=MESSAGES, max_new_tokens=10, ignore_eos=True, readout=True)
    stats = engine.generate(request, level).result()
    assert stats.readout is not None and stats.completion_tokens == 10
    return stats.token_ids, stats.readout


def _same(got: AnswerReadout, want: AnswerReadout) -> None:
    assert got.layers == want.layers
    torch.testing.assert_close(got.hidden, want.hidden, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.lookback, want.lookback, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.entropy, want.entropy, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("level", [Level.DENSE, Level.BALANCED])
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_every_pass_reads_the_same_readout(family: str, level: Level, native: Any) -> None:
    engine = tiny_engine(cache=False, family=family)
    answer, reference = _generate(engine, level)
    assert reference.hidden.abs().sum() > 0 and (reference.lookback > 0).all()
    assert ((reference.lookback <= 1 + 1e-6) & (reference.entropy >= 0)).all()
    for compiled in (native, None):
        engine.enable_fast_path(native=compiled)
        fast_answer, fast = _generate(engine, level)
        assert fast_answer == answer
        _same(fast, reference)
    proxied = score_tokens(engine, MESSAGES, answer, level, measure_drift=False, readout=True)
    assert proxied.readout is not None
    _same(proxied.readout, reference)


def test_readout_positions() -> None:
    """A prompt of 3 tokens and an answer of 3, teacher-forced: the last prompt token's and the
    first answer token's rows, the mean of the answer rows that are read back (positions 3 and
    4), and the queries that predict answer tokens (positions 2, 3 and 4)."""
    readout = Readout(num_layers=10, heads=1, width=1, prompt_len=3, limit=5)
    layer = read_layers(10)[0]
    rows = torch.arange(6, dtype=torch.float32)[:, None]  # the row at position p holds p
    readout.observe_hidden(layer, rows, start=0)
    probs = torch.zeros(1, 6, 6)
    probs[0, :, 0] = 1.0  # every query on the first prompt token
    probs[0, 4] = torch.tensor([0.25, 0.25, 0.0, 0.25, 0.25, 0.0])
    readout.observe_attention(layer, probs, start=0)
    result = readout.result()
    assert result.hidden[:, 0, 0].tolist() == [2.0, 3.0, 3.5]
    assert result.lookback[layer, 0].item() == pytest.approx((1 + 1 + 0.5) / 3)
    assert result.entropy[layer, 0].item() == pytest.approx(
        4 * 0.25 * torch.log(torch.tensor(4.0)).item() / 3
    )
