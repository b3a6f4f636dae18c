"""`sparseguard probe`: run a text through the engine and print its internal signals."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any

from services.cli.common import emit, emit_json, store
from services.config import Settings
from services.shared.engine import build_engine
from sparse_engine.calibration.store import CalibrationNotFoundError
from sparse_engine.runtime.engine import GenerationRequest, GenerationStats
from sparse_engine.sparsity.plan import Level
from sparse_engine.sparsity.signals import late_silence

BUILTIN_SAMPLE = "Explain in two sentences why the sky looks blue during the day and red at sunset."
# A probe task names the domain of the input; the engine prefers a calibration made on it.
TASK_CORPORA = {
    "chat": "sharegpt",
    "wiki": "wiki",
    "code": "code",
    "qa": "halueval",
    "technical": "technical",
}


def register(commands: Any) -> None:
    p = commands.add_parser("probe", help="run a prompt file and print [IR_SPARSE_STATS]")
    p.add_argument("--input", type=Path, help="prompt text file (default: a built-in sample)")
    p.add_argument("--model", help="model name, HF directory or GGUF file")
    p.add_argument("--level", help="dense|conservative|balanced|aggressive (default: settings)")
    p.add_argument(
        "--task", choices=sorted(TASK_CORPORA), help="input domain; prefers a calibration on it"
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--json", action="store_true", help="one JSON object instead of the text block")
    p.set_defaults(handler=run_probe)


def run_probe(args: argparse.Namespace, settings: Settings) -> int:
    text = read_prompt(args.input)
    level = Level.parse(args.level or settings.engine.default_level)
    eng = build_engine(settings, args.model)
    if args.task and level is not Level.DENSE:
        with contextlib.suppress(CalibrationNotFoundError):
            cal = store(settings).latest(eng.lm.weights_sha256, level, TASK_CORPORA[args.task])
            eng.plans[level] = cal.plan()
    request = GenerationRequest(
        messages=[{"role": "user", "content": text}],
        max_new_tokens=args.max_new_tokens,
        measure_drift=True,
    )
    stats = eng.generate(request, level).result()
    report = to_report(stats, args.task, settings.signals.late_band)
    if args.json:
        emit_json(report)
    else:
        emit(stats.text)
        emit(format_block(report))
    return 0


def read_prompt(path: Path | None) -> str:
    if path is None:
        return BUILTIN_SAMPLE
    if not path.is_file():
        raise FileNotFoundError(f"input file not found: {path}; pass --input with a text file")
    text = path.read_text(encoding="utf-8", errors="replace").strip()
    if not text:
        raise ValueError(f"input file {path} is empty")
    return text


def to_report(stats: GenerationStats, task: str | None, late_band: int) -> dict[str, Any]:
    sig = stats.signals
    if sig is None:
        raise ValueError("probe needs signals")
    silence = sig.silence_rate_per_layer
    return {
        "answer": stats.text,
        "level": stats.level,
        "task": task,
        "calibration_version": stats.calibration_version,
        "sparsity_ratio": round(sig.sparsity_ratio, 4),
        "sparsity_per_layer": [round(v, 4) for v in sig.sparsity_per_layer],
        "activation_stability": round(sig.activation_stability_pct, 3),
        "semantic_drift_kl": round(stats.semantic_drift_kl or 0.0, 5),
        "gate_confidence": round(sig.gate_confidence, 4),
        "gate_entropy": round(sig.gate_entropy, 4),
        "silence_rate_per_layer": [round(v, 4) for v in silence],
        "silence_late_band": round(late_silence(silence, late_band), 4),
        "input_entropy_bits_per_char": round(stats.input_entropy_bits_per_char, 3),
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "time_to_first_token_ms": round(stats.time_to_first_token_s * 1000, 1),
        "decode_tokens_per_s": round(stats.decode_tokens_per_s, 2),
    }


def format_block(r: dict[str, Any]) -> str:
    silence = r["silence_rate_per_layer"]
    peak = max(range(len(silence)), key=silence.__getitem__)
    return "\n".join(
        [
            "[IR_SPARSE_STATS]",
            f"SPARSITY_RATIO: {r['sparsity_ratio']:.4f}",
            f"ACTIVATION_STABILITY: {r['activation_stability']:.2f}% (CV of per-step sparsity)",
            f"SEMANTIC_DRIFT: {r['semantic_drift_kl']:.5f} (KL dense||sparse, nats/token)",
            f"GATE_CONFIDENCE: {r['gate_confidence']:.4f}",
            f"SILENCE: mean {sum(silence) / len(silence):.3f}, "
            f"max {silence[peak]:.3f} (layer {peak}), late band {r['silence_late_band']:.3f}",
            f"LEVEL: {r['level']}" + (f" (task {r['task']})" if r["task"] else ""),
            f"CALIBRATION: {r['calibration_version'] or 'none (dense)'}",
            f"INPUT_ENTROPY: {r['input_entropy_bits_per_char']:.3f} bits/char",
            f"TOKENS: prompt {r['prompt_tokens']}, completion {r['completion_tokens']}; "
            f"TTFT {r['time_to_first_token_ms']:.0f} ms; "
            f"decode {r['decode_tokens_per_s']:.1f} tok/s",
            "[/IR_SPARSE_STATS]",
        ]
    )
