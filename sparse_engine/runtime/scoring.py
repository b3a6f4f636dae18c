"""Teacher-forced probe: the signals of a given answer to a prompt (proxy mode), from one
sparse forward pass over prompt + answer, plus one dense pass when drift is wanted. Several
answers under one plan run as one right-padded batch (`score_many`): each row's hooks and
readout see only its own positions (`RowRecorders`, `RowReadouts`), so each gets the signals
it would have got alone."""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from sparse_engine.runtime.engine import Engine
from sparse_engine.runtime.generation import GenerationStats, Message
from sparse_engine.runtime.heads import span_logits
from sparse_engine.sparsity import signals
from sparse_engine.sparsity.hooks import read_out, sparsified
from sparse_engine.sparsity.plan import Level, SparsityPlan
from sparse_engine.sparsity.readout import Readout, RowReadouts
from sparse_engine.sparsity.recorder import RowRecorders, SignalRecorder


@dataclass(frozen=True, slots=True)
class Probe:
    """One answer to score: `answer_ids` its tokens, `text` its text if known."""

    messages: list[Message]
    answer_ids: list[int]
    measure_drift: bool
    text: str | None = None


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
    probe = Probe(messages, answer_ids, measure_drift, text)
    return score_many(engine, [probe], level, readout)[0]


def score_many(
    engine: Engine, probes: list[Probe], level: Level | SparsityPlan, readout: bool = False
) -> list[GenerationStats]:
    """`score_tokens` of several answers under one plan, in one forward pass."""
    plan = engine.plan(level)
    prompts = [engine.encode_messages(p.messages) for p in probes]
    for prompt, probe in zip(prompts, probes, strict=True):
        engine.check_length(len(prompt), max(len(probe.answer_ids), 1))
    rows = [prompt + p.answer_ids for prompt, p in zip(prompts, probes, strict=True)]
    lengths = [len(row) for row in rows]
    width = max(lengths)
    ids = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    recorders = []
    for prompt, n in zip(prompts, lengths, strict=True):
        recorder = SignalRecorder(engine.lm.num_layers, plan.silence_thresholds)
        recorder.track_positions(n)
        recorder.answer_start = len(prompt)
        recorders.append(recorder)
    readers = [
        engine._readout(len(prompt), n - 1) for prompt, n in zip(prompts, lengths, strict=True)
    ]
    batched = len(probes) > 1
    recorder = RowRecorders(recorders, lengths) if batched else recorders[0]
    reader: Readout = RowReadouts(readers, lengths) if batched else readers[0]
    mask = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    started = time.perf_counter()
    with (
        torch.inference_mode(),
        sparsified(engine.lm.layers, plan, recorder),
        read_out(engine.lm.model, engine.lm.layers, reader) if readout else nullcontext(),
    ):
        recorder.begin_step()
        spans = [(len(prompt) - 1, n - 1) for prompt, n in zip(prompts, lengths, strict=True)]
        answers = span_logits(engine.lm.model, ids, mask if batched else None, spans)
        recorder.end_step()
    elapsed = time.perf_counter() - started
    wanted = [
        (i, (prompt, p.answer_ids, answers[i]))
        for i, (prompt, p) in enumerate(zip(prompts, probes, strict=True))
        if p.measure_drift and not plan.is_dense and p.answer_ids
    ]
    drifts = dict(
        zip([i for i, _ in wanted], engine.semantic_drift_many([x for _, x in wanted]), strict=True)
    )
    rate = sum(lengths) / max(elapsed, 1e-9)
    out = []
    for i, probe in enumerate(probes):
        stats = _stats(engine, plan, probe, prompts[i], answers[i], recorders[i])
        stats.readout = readers[i].result() if readout else None
        stats.semantic_drift_kl = drifts.get(i, 0.0) if probe.measure_drift else None
        stats.prefill_tokens_per_s = rate
        out.append(stats)
    return out


def _stats(
    engine: Engine,
    plan: SparsityPlan,
    probe: Probe,
    prompt_ids: list[int],
    answer_logits: torch.Tensor,  # at the positions that predict each answer token
    recorder: SignalRecorder,
) -> GenerationStats:
    """The statistics a probe's pass gives (readout, drift and speed are set by the caller)."""
    answer_ids = probe.answer_ids
    summary = recorder.summary()
    answer_steps = recorder.position_sparsity()[len(prompt_ids) :]
    summary.step_sparsity = answer_steps
    summary.activation_stability_pct = signals.coefficient_of_variation_pct(answer_steps)
    predicted = answer_logits.float().log_softmax(-1)
    chosen = predicted.gather(
        -1, torch.tensor(answer_ids, dtype=torch.long).reshape(-1, 1)
    ).reshape(-1)
    return GenerationStats(
        text=engine.lm.tokenizer.decode(answer_ids) if probe.text is None else probe.text,
        level=plan.level.value,
        calibration_version=plan.calibration_version,
        prompt_tokens=len(prompt_ids),
        completion_tokens=len(answer_ids),
        finish_reason="stop",
        time_to_first_token_s=0.0,
        decode_tokens_per_s=0.0,
        prefill_tokens_per_s=0.0,
        input_entropy_bits_per_char=signals.entropy_bits_per_char(
            "\n".join(m["content"] for m in probe.messages)
        ),
        signals=summary,
        token_ids=answer_ids,
        token_logprobs=chosen.tolist(),
        token_entropies=signals.entropy_nats(predicted).tolist(),
    )
