"""`sparseguard eval retrieval`: does fallback retrieval pay for itself? Closed book: each
question of a QA set's eval half is asked without its passage; the knowledge base holds every
passage of the set (a private SQLite database under <home>/eval). Accuracy is measured for
never retrieving, always retrieving (the gateway's own prompt with the top passages) and
retrieving only when the trust score falls under the level's flag threshold (the regenerated
answer is the always-retrieve one: greedy decoding gives the same tokens), with the share of
requests regenerated; and likewise for `simplify` against its own baseline. Also the whole
trade-off: accuracy against the share regenerated, over every threshold; and the policies at a
route threshold learned for a regeneration budget on the fit half's closed-book answers (a
tolerance bound: with the given confidence at most that share of such answers falls under it),
which `SPARSEGUARD_TRUST__ACT_BELOW` sets. Beside the serve-mode model, two routes learned on
the fit half's closed-book and retrieved answers (`_learned_routes`): a closed-book trust model
(the stored closed-mode one, which the gateway serves for a route in `route_modes`, when it was
fit on this set's fit half) and a gain model (a study only). Answers are generated in batches,
as the gateway batches concurrent requests."""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from services.cli.common import emit, emit_json, eval_commands
from services.cli.retrieval_figures import (
    Answer,
    baselines,
    fixes,
    perfect_detector,
    policy,
    top_rank,
)
from services.config import Settings
from services.gateway.fallback import simplified, with_passages
from services.shared.engine import build_engine
from services.storage import kb as knowledge
from services.storage.db import make_engine, session_factory, upgrade
from sparse_engine.data.qa_sets import QA_SETS
from sparse_engine.runtime.engine import Engine
from sparse_engine.runtime.generation import GenerationRequest, Message
from sparse_engine.runtime.offline import generate_all
from sparse_engine.sparsity.plan import Level
from sparse_engine.sparsity.signals import TEXT
from sparse_engine.trust.features import RequestSignals, from_stats
from sparse_engine.trust.flagging import flag_threshold, tolerance_floor
from sparse_engine.trust.model import TrustModel, TrustModelNotFoundError, TrustStore, out_of_fold
from sparse_engine.trust.model import fit as fit_trust
from sparse_engine.trust.qa import QAItem, grade, load_qa, qa_messages, qa_sample

log = logging.getLogger(__name__)


def register(commands: Any) -> None:
    cmd = eval_commands(commands).add_parser(
        "retrieval", help="accuracy with never, always and low-trust retrieval, closed book"
    )
    cmd.add_argument("--data", default="halueval", choices=list(QA_SETS))
    cmd.add_argument("--n", type=int, default=200, help="items (about; from the eval half)")
    cmd.add_argument("--level", default="balanced")
    cmd.add_argument("--k", type=int, default=3, help="passages per retrieval")
    cmd.add_argument("--max-new-tokens", type=int, default=32)
    cmd.add_argument(
        "--budget",
        type=float,
        default=0.5,
        help="share of requests a route may regenerate: its threshold is learned on the fit half",
    )
    cmd.add_argument(
        "--confidence",
        type=float,
        default=0.9,
        help="probability that the route's threshold keeps within --budget on new traffic",
    )
    cmd.add_argument("--model", help="model name, HF directory or GGUF file")
    cmd.add_argument("--json", action="store_true", help="print the figures as JSON")
    cmd.set_defaults(handler=run_retrieval)


def run_retrieval(args: argparse.Namespace, settings: Settings) -> int:
    if args.n < 1 or args.k < 1:
        raise ValueError("--n and --k must be at least 1")
    if not 0.0 < args.budget < 1.0:
        raise ValueError("--budget is a share of requests, between 0 and 1 (e.g. 0.5)")
    if not 0.0 < args.confidence < 1.0:
        raise ValueError("--confidence is a probability, between 0 and 1 (e.g. 0.9)")
    level = Level.parse(args.level)
    items = load_qa(args.data, settings.cache_home)
    indices = qa_sample(items, "eval", args.n)
    eng = build_engine(settings, args.model)
    model = TrustStore(settings.trust_dir).latest(eng.lm.model_id, level.value, "serve")
    search = _knowledge_base(settings, args.data, items)
    closed = [QAItem(items[i].question, items[i].answers) for i in indices]
    fit = [QAItem(items[i].question, items[i].answers) for i in qa_sample(items, "fit", args.n)]

    def ask(
        name: str, prompt: Callable[[QAItem], list[Message]], asked: list[QAItem] = closed
    ) -> tuple[list[Answer], list[RequestSignals]]:
        return _answers(eng, model, asked, [prompt(i) for i in asked], level, args, name)

    never, never_signals = ask("never retrieve", qa_messages)
    hits = {item.question: search(item.question, args.k) for item in closed}
    always, _ = ask(
        "always retrieve", lambda item: with_passages(qa_messages(item), hits[item.question], 800)
    )
    simple, _ = ask("always simplify", lambda item: simplified(qa_messages(item)))
    own = flag_threshold(model, level.value, TEXT)  # what the gateway flags questions below
    threshold = settings.trust.min_score if own is None else own
    fit_answers, fit_signals = ask("fit half, closed book", qa_messages, fit)
    fit_scores = [s for _, s in fit_answers]
    learned = _route_threshold(fit_scores, args)
    hits.update({item.question: search(item.question, args.k) for item in fit})
    fit_retrieved, _ = ask(
        "fit half, retrieved",
        lambda item: with_passages(qa_messages(item), hits[item.question], 800),
        fit,
    )
    ranks = [top_rank(hits[i.question]) for i in closed]
    routes = _learned_routes(
        (eng.lm.model_id, level.value, args),
        (fit_signals, fit_answers, fit_retrieved),
        (never_signals, never, always),
        ranks,
        _served_route_model(settings, eng.lm.model_id, level.value, args.data),
    )
    figures = {
        "data": args.data,
        "n": len(indices),
        "level": level.value,
        "trust_model": model.version,
        "flag_threshold": threshold,
        "retrieve": policy(never, always, threshold),
        "simplify": policy(never, simple, threshold),
        "retrieval_fixes": fixes(never, always, ranks),
        "perfect_detector_gain": perfect_detector(never, always, args.budget),
        "budget": args.budget,
        "confidence": args.confidence,
        "fit_n": len(fit),
        "route_threshold": learned,
        "fit_share_under": round(sum(s < learned for s in fit_scores) / len(fit), 4),
        "retrieve_at_budget": policy(never, always, learned),
        "simplify_at_budget": policy(never, simple, learned),
        "closed_book_baselines": baselines(never, never_signals),
        **routes,
    }
    if args.json:
        emit_json(figures)
    else:
        _print(figures)
    return 0


def _answers(
    eng: Engine,
    model: TrustModel,
    items: list[QAItem],
    prompts: list[list[Message]],
    level: Level,
    args: argparse.Namespace,
    name: str,
) -> tuple[list[Answer], list[RequestSignals]]:
    """Each item's answer, graded, with its trust score; and its signals."""
    jobs = [
        (
            GenerationRequest(
                messages=messages,
                max_new_tokens=args.max_new_tokens,
                measure_drift=True,
                readout=True,
            ),
            level,
        )
        for messages in prompts
    ]
    with tqdm(total=len(jobs), unit="answer", desc=name) as bar:
        answers = generate_all(eng, jobs, progress=bar.update)
    signals = [
        from_stats(stats, m[-1]["content"]) for m, stats in zip(prompts, answers, strict=True)
    ]
    graded = [
        (grade(stats.text, item.answers).correct, model.score(sig))
        for item, stats, sig in zip(items, answers, signals, strict=True)
    ]
    return graded, signals


Half = tuple[list[RequestSignals], list[Answer], list[Answer]]  # closed-book, then retrieved


def _learned_routes(
    setup: tuple[str, str, argparse.Namespace],
    fit: Half,
    test: Half,
    ranks: list[float],
    served: TrustModel | None = None,
) -> dict[str, Any]:
    """Two routes learned on the fit half, each read off its closed-book answer's signals:
    `route_model`, a trust model of a right closed-book answer (retry the least trusted;
    `served`, the stored closed-mode model the gateway serves, when given), and `gain_model`,
    that less a model of a right answer after retrieval (retry where the expected gain is
    largest). Thresholds come from out-of-fold scores: in-sample ones would be too sure of the
    answers the models were fit on."""
    model_id, level, args = setup
    fit_signals, fit_first, fit_second = fit
    signals, first, second = test
    labels = [[r for r, _ in fit_first], [r for r, _ in fit_second]]

    def fitted(right: list[bool], setting: str) -> TrustModel:
        data = {"data": args.data, "split": "fit", "setting": setting}
        return fit_trust(fit_signals, right, model_id=model_id, level=level, fit_data=data)

    models = [
        served or fitted(labels[0], "closed book"),
        fitted(labels[1], "closed book, retrieved"),
    ]
    held_out = [out_of_fold(fit_signals, y, m) for y, m in zip(labels, models, strict=True)]
    closed, after = ([m.score(s) for s in signals] for m in models)
    scores = {
        "route_model": (held_out[0], closed),
        "gain_model": ([a - b for a, b in zip(*held_out, strict=True)],
                       [a - b for a, b in zip(closed, after, strict=True)]),
    }  # fmt: skip
    out = {}
    for (name, (fit_scores, test_scores)), model in zip(scores.items(), models, strict=True):
        threshold = _route_threshold(fit_scores, args)
        scored = [(r, score) for (r, _), score in zip(first, test_scores, strict=True)]
        out[name] = {
            "served": model.version if model is served else None,
            **{k: model.fit_data[k] for k in ("items", "right", "groups", "l2", "cv_auroc")},
            "threshold": threshold,
            "retrieval_fixes": fixes(scored, second, ranks),
            "retrieve_at_budget": policy(scored, second, threshold),
        }
    return out


def _served_route_model(
    settings: Settings, model_id: str, level: str, data: str
) -> TrustModel | None:
    """The closed-mode trust model the gateway would serve (`trust fit --mode closed`), when
    one was fit on this set's fit half; else None (the study fits its own)."""
    try:
        model = TrustStore(settings.trust_dir).latest(model_id, level, "closed")
    except TrustModelNotFoundError:
        return None
    if model.fit_data.get("data") != data or model.fit_data.get("split") != "fit":
        log.warning(
            "closed-mode trust model %s was fit on %s's %s half, not %s's fit half: the study "
            "fits its own",
            model.version, model.fit_data.get("data"), model.fit_data.get("split"), data,
        )  # fmt: skip
        return None
    return model


def _route_threshold(scores: list[float], args: argparse.Namespace) -> float:
    learned = tolerance_floor(scores, args.budget, args.confidence)
    if math.isinf(learned):
        raise ValueError(
            f"the fit half's {len(scores)} closed-book answers are too few to hold a "
            f"{args.budget:.0%} budget with {args.confidence:.0%} confidence: raise --n"
        )
    return learned


def _knowledge_base(
    settings: Settings, data: str, items: list[QAItem]
) -> Callable[[str, int], list[knowledge.Hit]]:
    """A search over every passage of the set, in its own SQLite database (made once)."""
    path = settings.home / "eval" / f"kb-{data}.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{path}"
    upgrade(url)
    sessions = session_factory(make_engine(url))
    with sessions() as session:
        if knowledge.count(session) == 0:
            texts = dict.fromkeys(i.context for i in items if i.context)
            passages = [
                knowledge.Passage(data, "", piece)
                for text in texts
                for piece in knowledge.chunk(text, 800)
            ]
            result = knowledge.ingest(session, passages)
            session.commit()
            log.info("knowledge base %s: %d passages", Path(path).name, result.added)

    def search(query: str, k: int) -> list[knowledge.Hit]:
        with sessions() as session:
            return knowledge.search(session, query, k)

    return search


def _print(f: dict[str, Any]) -> None:
    emit(
        f"{f['data']}, closed book, {f['n']} questions at {f['level']}; trust model "
        f"{f['trust_model']}, flag threshold {f['flag_threshold']:.3f}"
    )
    for action in ("retrieve", "simplify"):
        _print_policy(action, f[action])
    x = {k: _shown(v) for k, v in f["retrieval_fixes"].items()}
    emit(
        f"retrieval fixes {f['retrieval_fixes']['fixes']} closed-book answers and breaks "
        f"{f['retrieval_fixes']['breaks']}; AUROC of the trust score for a right closed-book "
        f"answer {x['trust_auroc_right']}, for a fix: low trust {x['low_trust_auroc_fix']}, "
        f"the best passage's rank {x['match_auroc_fix']}"
    )
    emit(
        f"route threshold {f['route_threshold']:.3f}: with {100 * f['confidence']:.0f} % "
        f"confidence at most {100 * f['budget']:.0f} % of answers like the fit half's "
        f"{f['fit_n']} closed-book ones fall under it ({100 * f['fit_share_under']:.0f} % of "
        "them did)"
    )
    for action in ("retrieve", "simplify"):
        _print_policy(action, f[f"{action}_at_budget"])
    emit(
        "to act at it: SPARSEGUARD_TRUST__ACT_BELOW="
        f"'{{\"/v1/chat/completions\": {f['route_threshold']:.3f}}}'"
    )
    emit(
        "baselines, AUROC for a right closed-book answer: "
        + "  ".join(f"{k} {_shown(v)}" for k, v in f["closed_book_baselines"].items())
    )
    for name, what in (("route_model", "right"), ("gain_model", "right after retrieval")):
        r, why = f[name], f[name]["retrieval_fixes"]
        served = f" (served: {r['served']})" if r["served"] else ""
        emit(
            f"{name}{served}: fit on the fit half's {r['items']} closed-book answers ({r['right']} "
            f"{what}; groups {', '.join(r['groups'])}, cv AUROC {_shown(r['cv_auroc'])}); on the "
            f"eval half AUROC for a right answer {_shown(why['trust_auroc_right'])}, low score "
            f"for a fix {_shown(why['low_trust_auroc_fix'])}; route threshold "
            f"{r['threshold']:.3f} (from out-of-fold scores)"
        )
        _print_policy("retrieve", r["retrieve_at_budget"])
        if r["served"]:
            emit(
                'to retrieve on it: SPARSEGUARD_TRUST__ROUTE_MODES=\'{"/v1/chat/completions": '
                f'"closed"}}\' SPARSEGUARD_TRUST__ACT_BELOW=\'{{"/v1/chat/completions": '
                f"{r['threshold']:.3f}}}'"
            )
    best = f["perfect_detector_gain"]
    emit(
        f"a perfect detector of right closed-book answers would recover "
        f"{'n/a' if best is None else f'{100 * best:.0f} %'} of the gain within the "
        f"{100 * f['budget']:.0f} % budget (expected; nothing breaks, fixes found by chance)"
    )


def _shown(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _print_policy(action: str, p: dict[str, Any]) -> None:
    recovered = "n/a" if p["gain_recovered"] is None else f"{100 * p['gain_recovered']:.0f} %"
    emit(
        f"{action:<9} never {p['never']:.3f}  always {p['always']:.3f}  on low trust "
        f"{p['on_low_trust']:.3f} ({100 * p['regenerated']:.0f} % regenerated; "
        f"{recovered} of the gain)"
    )
