"""Teacher-forced probe: the signals of a given answer to a prompt (proxy mode), from one
sparse forward pass over prompt + answer, plus one dense pass when drift is wanted."""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from sparse_engine.runtime.engine import Engine
from sparse_engine.runtime.generation import GenerationStats, Message
from sparse_engine.sparsity import signals
from sparse_engine.sparsity.hooks import read_out, sparsified
from sparse_engine.sparsity.plan import Level, SparsityPlan
from sparse_engine.sparsity.recorder import SignalRecorder


def score_answer(
    engine: Engine,
    messages: list[Message],
    answer: str,
    level: Level | SparsityPlan,
    measure_drift: bool,
    readout: bool = False,
) -> GenerationStats:
    """Signals of `answer` as if the engine had produced it at `level` (or under a pinned
    plan). Per-step sparsity is per answer position; activation stability is its variation
    over those positions. `readout`: also the trust readout, read off the same pass."""
    answer_ids = engine.encode_text(answer)
    return score_tokens(engine, messages, answer_ids, level, measure_drift, readout, answer)


def score_tokens(
    engine: Engine,
    messages: list[Message],
    answer_ids: list[int],
    level: Level | SparsityPlan,
    measure_drift: bool,
    readout: bool = False,
    text: str | None = None,
) -> GenerationStats:
    """`score_answer` of an answer given as token ids (`text`: its text, if known)."""
    plan = engine.plan(level)
    prompt_ids = engine.encode_messages(messages)
    engine.check_length(len(prompt_ids), max(len(answer_ids), 1))
    ids = torch.tensor([prompt_ids + answer_ids])
    recorder = SignalRecorder(engine.lm.num_layers, plan.silence_thresholds)
    recorder.track_positions(ids.shape[1])
    recorder.answer_start = len(prompt_ids)
    reader = engine._readout(len(prompt_ids), ids.shape[1] - 1) if readout else None
    started = time.perf_counter()
    with (
        torch.inference_mode(),
        sparsified(engine.lm.layers, plan, recorder),
        read_out(engine.lm.model, engine.lm.layers, reader) if reader else nullcontext(),
    ):
        recorder.begin_step()
        sparse_logits = engine.lm.model(input_ids=ids).logits[0]
        recorder.end_step()
    elapsed = time.perf_counter() - started
    summary = recorder.summary()
    answer_steps = recorder.position_sparsity()[len(prompt_ids) :]
    summary.step_sparsity = answer_steps
    summary.activation_stability_pct = signals.coefficient_of_variation_pct(answer_steps)
    predicted = sparse_logits[len(prompt_ids) - 1 : -1].float().log_softmax(-1)
    chosen = predicted.gather(
        -1, torch.tensor(answer_ids, dtype=torch.long).reshape(-1, 1)
    ).reshape(-1)
    drift = None
    if measure_drift:
        drift = 0.0
        if not plan.is_dense and answer_ids:
            positions = sparse_logits[len(prompt_ids) - 1 : -1]
            drift = engine.semantic_drift(prompt_ids, answer_ids, positions)
    return GenerationStats(
        text=engine.lm.tokenizer.decode(answer_ids) if text is None else text,
        level=plan.level.value,
        calibration_version=plan.calibration_version,
        prompt_tokens=len(prompt_ids),
        completion_tokens=len(answer_ids),
        finish_reason="stop",
        time_to_first_token_s=0.0,
        decode_tokens_per_s=0.0,
        prefill_tokens_per_s=ids.shape[1] / max(elapsed, 1e-9),
        input_entropy_bits_per_char=signals.entropy_bits_per_char(
            "\n".join(m["content"] for m in messages)
        ),
        signals=summary,
        semantic_drift_kl=drift,
        token_ids=answer_ids,
        token_logprobs=chosen.tolist(),
        token_entropies=signals.entropy_nats(predicted).tolist(),
        readout=reader.result() if reader is not None else None,
    )
