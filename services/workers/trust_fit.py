"""Fitting the trust model: answer graded QA items at a level, fit the logistic model on their
signals, save it; one model per level asked for (a model fit at one level scores another's
answers by extrapolation: a balanced model put Gemma 3's dense answers near 0, README).
`sparseguard trust fit` runs it in the foreground; the Celery `trust_fit` job
(`fit_trust`, queued by `sparseguard up` when the served model has none) runs it after the
stack is up and publishes the model on the control topic, where every gateway serving the
model installs it without a restart.

A job makes at most one model a level: each records its job id, so a retried job finds those it
made and only publishes them again. With `if_missing`, a job skips the levels that already have
a model, so a second job queued before the first finished costs only a model load."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from services.config import Settings
from services.shared.engine import build_engine
from services.telemetry.control import publish_trust_model
from services.workers.jobs import ClaimedJob
from sparse_engine.data import traffic
from sparse_engine.jsonstore import JsonStore
from sparse_engine.runtime.engine import Engine
from sparse_engine.sparsity.plan import Level
from sparse_engine.trust.evaluate import QARecord, RecordSet, collect
from sparse_engine.trust.features import RequestSignals
from sparse_engine.trust.flagging import healthy_signals, set_flag_thresholds
from sparse_engine.trust.model import TrustModel, TrustModelNotFoundError, TrustStore, fit
from sparse_engine.trust.proxy import Given, score_given, upstream_answers
from sparse_engine.trust.qa import HALUEVAL, QAItem, load_qa, qa_sample

log = logging.getLogger(__name__)
ALL = "all"  # in a spec's levels: every served level not named before it
LOG_EVERY = 25  # answers between progress lines in a worker's log
Progress = Callable[[int], object]


class FitSpec(BaseModel):
    """What to answer and fit on; a job's params are these fields (all optional). Items come
    from the `split` half of the set (`trust.qa.qa_sample`: passages never in both halves).
    Proxy mode scores answers teacher-forced, as the gateway's proxy mode does: those of the
    `upstream` model (a local model standing in for the upstream API), or the served model's
    own when none is named. Closed mode answers the questions without their passages, as a
    route that retrieves on low trust is asked them. `level`: one level, or several joined by
    ',' (one model each, fit in that order); `all` stands for every served level not named
    before it, so `balanced,all` fits balanced first, then dense and the other calibrated
    levels."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    data: str = HALUEVAL  # a packaged QA set or a QA JSONL file; several joined by '+' pool
    n: int = Field(200, ge=1)
    split: Literal["fit", "eval"] = "fit"
    level: str = "balanced"
    max_new_tokens: int = Field(32, ge=1)
    l2: float | None = Field(None, gt=0)
    model: str | None = None  # default: the served model
    mode: Literal["serve", "proxy", "closed"] = "serve"
    upstream: str | None = None  # proxy mode: the model whose answers are scored
    if_missing: bool = False

    @field_validator("level")
    @classmethod
    def _known_levels(cls, level: str) -> str:
        parts = [p.strip().lower() for p in level.split(",")]
        named = [p if p == ALL else Level.parse(p).value for p in parts]  # before the model loads
        if len(set(named)) < len(named):
            raise ValueError(f"{level!r} names a level twice")
        return ",".join(named)

    @model_validator(mode="after")
    def _upstream_in_proxy_mode(self) -> FitSpec:
        if self.upstream is not None and self.mode != "proxy":
            raise ValueError("upstream: only proxy mode scores an upstream's answers")
        return self

    def params(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)

    def levels(self, served: Iterable[Level]) -> list[Level]:
        """The levels to fit at, in order: those named, then for `all` the `served` ones (dense
        and each calibrated level) not named. A named level not served fails before any is
        answered."""
        parts, served = self.level.split(","), list(served)
        named = [Level(p) for p in parts if p != ALL]
        missing = [level.value for level in named if level not in served]
        if missing:
            raise ValueError(
                f"no calibration at {', '.join(missing)} for this model; run `sparseguard "
                f"calibrate --level {missing[0]}` or leave it out"
            )
        if ALL in parts:
            rest = sorted(set(served) - set(named), key=list(Level).index)
            named += rest
        return named


def answers(
    settings: Settings,
    eng: Engine,
    spec: FitSpec,
    progress: Progress = lambda _: None,
    upstream: Engine | None = None,
) -> list[QARecord]:
    """Graded answers with their signals and readout, of the served model (serve mode) or
    scored teacher-forced (proxy mode), cached under the trust directory so an interrupted run
    resumes where it stopped. `upstream`: the spec's upstream model, already loaded. Sets
    joined by '+' are pooled: `n` items of each."""
    parts = spec.data.split("+")
    if len(parts) > 1 and not Path(spec.data).is_file():
        return [
            record
            for part in parts
            for record in answers(
                settings, eng, spec.model_copy(update={"data": part}), progress, upstream
            )
        ]
    items = load_qa(spec.data, settings.cache_home)
    indices = qa_sample(items, spec.split, spec.n)
    level = Level.parse(spec.level)
    plan = eng.plan(level)
    source = {"serve": "", "closed": "closed-"}.get(spec.mode, f"proxy-{spec.upstream or 'self'}-")
    records_at = RecordSet(
        settings.trust_dir / "records",
        source + spec.data,
        eng.lm.model_id,
        plan.calibration_version or "dense",
        spec.max_new_tokens,
    )
    if spec.mode == "closed":  # the passages go after the halves were drawn by them
        items = [QAItem(item.question, item.answers) for item in items]
    if spec.mode != "proxy":
        return collect(eng, items, indices, level, records_at, progress=progress)
    if upstream is None:
        upstream = build_engine(settings, spec.upstream) if spec.upstream else eng
    name = f"{upstream.lm.model_id}-{Path(spec.data).stem}-{spec.max_new_tokens}t.jsonl"
    where = settings.trust_dir / "upstream" / name
    given = upstream_answers(upstream, items, indices, spec.max_new_tokens, where, progress)
    scored = [Given(2 * i, i, text) for i, text in given.items()]
    return score_given(eng, items, scored, level, records_at)


def fit_models(
    settings: Settings,
    eng: Engine,
    spec: FitSpec,
    levels: Iterable[Level],
    extra: dict[str, Any] | None = None,
    progress: Progress = lambda _: None,
) -> Iterator[tuple[TrustModel, list[QARecord]]]:
    """At each of `levels`: answer, fit, set the flag thresholds on healthy answers of each kind
    at every served level (`trust.flagging`; answered once, on the first model's turn) and save.
    Yields each model as it is saved, so the first can serve while the next is fit; `extra`
    goes into each model's fit_data. Of several levels, one whose answers cannot be fit (all
    right or all wrong) is logged and passed over, and scored by another level's model; one
    level alone raises."""
    cfg, prompts, levels = settings.trust, _flag_prompts(settings), list(levels)
    healthy: dict[Level, dict[str, list[RequestSignals]]] = {}
    for at in levels:
        records = answers(settings, eng, spec.model_copy(update={"level": at.value}), progress)
        try:
            model = fit(
                [r.signals for r in records],
                [r.correct for r in records],
                model_id=eng.lm.model_id,
                level=at.value,
                fit_data={
                    "data": spec.data,
                    "split": spec.split,
                    "n": len(records),
                    "level": at.value,
                    "upstream": spec.upstream,
                    **(extra or {}),
                },
                l2=spec.l2,
                late_band=settings.signals.late_band,
                mode=spec.mode,
            )
        except ValueError as exc:
            if len(levels) == 1:
                raise
            log.warning("no trust model at %s (%s); another level's scores it", at.value, exc)
            continue
        # Thresholds per served level and healthy kind: a sparser level's answers score lower,
        # so a threshold measured at one level flags a quarter of another's healthy chat, and
        # one measured on chat flagged most prose and summaries (README).
        for level in sorted(eng.plans, key=list(Level).index):  # dense and every sparse level
            if level not in healthy:
                healthy[level] = healthy_signals(
                    eng, level, prompts, spec.max_new_tokens, progress, spec.mode
                )
            set_flag_thresholds(
                model, healthy[level], cfg.flag_budget, level.value, prompts, cfg.flag_confidence
            )
        yield TrustStore(settings.trust_dir).save(model), records


def _flag_prompts(settings: Settings) -> list[traffic.Prompt]:
    """The healthy prompts of the flag thresholds: each kind both ways, as the baseline pass
    sends it."""
    cfg = settings.trust
    return traffic.half_with_system(
        [
            prompt
            for kind in cfg.flag_kinds
            for prompt in traffic.healthy(kind, settings.cache_home, "baseline", cfg.flag_requests)
        ]
    )


def fit_trust(settings: Settings, job: ClaimedJob, engine: Engine | None = None) -> dict[str, Any]:
    """The `trust_fit` job: fit a model at each of the spec's levels (but those this job already
    made, and with `if_missing` those that have one) and publish each on the control topic as it
    is saved. `engine`: the one to answer with (default: the served model as the gateway builds
    it)."""
    spec = FitSpec.model_validate(job.params)  # ValidationError: a ValueError
    eng = engine or build_engine(settings, spec.model)
    levels = [level.value for level in spec.levels(eng.plans)]
    made = {level: m for level, m in made_by(settings, job.id).items() if level in levels}
    have = existing(settings, eng.lm.model_id, levels, spec.mode) if spec.if_missing else {}
    kept = {level: m.version for level, m in have.items() if level not in made}
    for level, version in kept.items():
        log.info("job %d: trust model %s exists; %s skipped", job.id, version, level)
    for model in made.values():
        log.info("job %d already made %s; publishing it", job.id, model.version)
        publish_trust_model(settings.telemetry, model, job.reason)
    todo = [Level(level) for level in levels if level not in made and level not in kept]
    if todo:
        log.info("job %d: answering %d %s items at %s", job.id, spec.n, spec.data, todo)
        extra = {"job_id": job.id, "reason": job.reason}
        total = spec.n * len(todo) + healthy_answers(settings, eng)
        progress = _log_progress(job.id, total)
        for model, _ in fit_models(settings, eng, spec, todo, extra, progress):
            publish_trust_model(settings.telemetry, model, job.reason)
            log.info("published trust model %s (%s)", model.version, job.reason)
            made[model.level] = model
        if not any(level.value in made for level in todo):
            raise ValueError(
                f"no trust model at {', '.join(level.value for level in todo)}: the answers at "
                "each were all right or all wrong; answer more items (n)"
            )
    return {
        "model": eng.lm.model_id,
        "unfit": [level.value for level in todo if level.value not in made],
        "models": {
            level: {
                "version": m.version,
                **{
                    k: m.fit_data[k]
                    for k in ("items", "right", "cv_auroc", "nested_auroc", "chance_auroc")
                },
            }
            for level, m in made.items()
        },
        "skipped": kept,
    }


def made_by(settings: Settings, job_id: int) -> dict[str, TrustModel]:
    """The trust models that job `job_id` saved, by level."""
    return {
        data["level"]: TrustModel.from_dict(data)
        for data in JsonStore(settings.trust_dir).all("trust-*.json")
        if data.get("fit_data", {}).get("job_id") == job_id
    }


def existing(
    settings: Settings, model_id: str, levels: Iterable[str], mode: str
) -> dict[str, TrustModel]:
    """The newest `mode` model of `model_id` at each of `levels` that has one."""
    store, found = TrustStore(settings.trust_dir), {}
    for level in levels:
        try:
            found[level] = store.latest(model_id, level, mode)
        except TrustModelNotFoundError:
            continue
    return found


def healthy_answers(settings: Settings, eng: Engine) -> int:
    """How many healthy answers the flag thresholds take (at most: too long ones are skipped)."""
    return len(eng.plans) * len(settings.trust.flag_kinds) * settings.trust.flag_requests


def _log_progress(job_id: int, total: int) -> Progress:
    done = [0]

    def step(count: int) -> None:
        done[0] += count
        if done[0] % LOG_EVERY == 0 or done[0] == total:
            log.info("job %d: %d/%d answers", job_id, done[0], total)

    return step
