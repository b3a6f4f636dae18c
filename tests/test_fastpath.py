"""The lean decode path against the Hugging Face reference (tiny Llama): the same logits in
dense mode, the same as the masked reference at the same thresholds in sparse mode, and the
same signals as the hooks record."""

from __future__ import annotations

import pytest
import torch

from sparse_engine.arch import UnsupportedModelError
from sparse_engine.fastpath import FastDecoder
from sparse_engine.hooks import sparsified
from sparse_engine.plan import Level
from sparse_engine.recorder import SignalRecorder
from sparse_engine.speed import SpeedRow, fast_speed, stream_bandwidth
from tests.tiny import tiny_engine, tiny_model

TEXT = "Once upon a time there was a little robot who"


def _reference(level: Level) -> tuple[torch.Tensor, SignalRecorder]:
    engine = tiny_engine(cache=False)
    ids = engine.encode_text(TEXT)
    recorder = SignalRecorder(engine.lm.num_layers)
    with torch.inference_mode(), sparsified(engine.lm.layers, engine.plan(level), recorder):
        recorder.begin_step()
        logits = engine.lm.model(input_ids=torch.tensor([ids])).logits[0]
        recorder.end_step()
    return logits, recorder


def _fast(level: Level, sparse_rows: bool) -> tuple[torch.Tensor, SignalRecorder]:
    engine = tiny_engine(cache=False)
    ids = engine.encode_text(TEXT)
    decoder = FastDecoder(engine.lm, max_len=64, sparse_rows=sparse_rows)
    recorder = SignalRecorder(engine.lm.num_layers)
    plan = engine.plan(level)
    rows = [decoder.prefill(ids[:5], plan, recorder)]
    rows += [decoder.step(token, plan, recorder) for token in ids[5:]]
    return torch.stack(rows), recorder


@pytest.mark.parametrize("level", [Level.DENSE, Level.BALANCED, Level.AGGRESSIVE])
@pytest.mark.parametrize("sparse_rows", [True, False])
def test_fast_path_matches_the_reference_logits_and_signals(
    level: Level, sparse_rows: bool
) -> None:
    reference, expected = _reference(level)
    fast, recorded = _fast(level, sparse_rows)
    torch.testing.assert_close(fast, reference[4:], atol=1e-5, rtol=1e-5)
    assert fast.argmax(-1).tolist() == reference[4:].argmax(-1).tolist()
    want, got = expected.summary(), recorded.summary()
    assert got.sparsity_per_layer == pytest.approx(want.sparsity_per_layer, abs=1e-9)
    assert got.silence_rate_per_layer == pytest.approx(want.silence_rate_per_layer)
    assert got.gate_confidence == pytest.approx(want.gate_confidence, abs=1e-6)
    if level is not Level.DENSE:
        assert got.sparsity_ratio > 0.3


def test_fast_path_refuses_what_it_cannot_run() -> None:
    engine = tiny_engine(cache=False)
    decoder = FastDecoder(engine.lm, max_len=8)
    with pytest.raises(ValueError, match="exceed the fast path's 8 tokens"):
        decoder.prefill(list(range(9)), engine.plan(Level.DENSE))
    with pytest.raises(UnsupportedModelError, match="Llama-family"):
        FastDecoder(tiny_model("gpt2"))


def test_speed_rows_count_the_weight_bytes_a_token_reads() -> None:
    engine = tiny_engine(cache=False)
    decoder = FastDecoder(engine.lm, max_len=64)
    ids = engine.encode_text(TEXT)
    dense_tps, dense_share = fast_speed(decoder, ids, engine, Level.DENSE, 4, 1)
    sparse_tps, sparse_share = fast_speed(decoder, ids, engine, Level.AGGRESSIVE, 4, 1)
    assert dense_share == 1.0 and 0.0 < sparse_share < 0.5  # aggressive: 70 % zeroed
    assert decoder.weight_bytes(sparse_share) < decoder.weight_bytes()
    head = engine.lm.model.lm_head.weight
    assert decoder.weight_bytes(0.0) > head.numel() * head.element_size()
    row = SpeedRow("fast", "dense", 50.0, 1e6, 2e9)
    assert row.ceiling_tokens_per_s == 2000.0 and row.ceiling_share == 0.025
    assert dense_tps > 0 and sparse_tps > 0 and stream_bandwidth(megabytes=8, repeats=1) > 1e8
