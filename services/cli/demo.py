"""`sparseguard demo`: real prompts (a ShareGPT sample and a few HaluEval questions) through a
running gateway, a line per answer, then the aggregator's view (requests, sparsity, gate
confidence, drift, trust actions) and the alerts firing (from the gateway's status data)."""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

import httpx

from services.cli.common import emit
from services.config import Settings
from sparse_engine.data import corpora

log = logging.getLogger(__name__)
SPARSE = ("conservative", "balanced", "aggressive")
MAX_PROMPT_CHARS = 600


def register(commands: Any) -> None:
    demo = commands.add_parser("demo", help="send real prompts through a running gateway")
    demo.add_argument("--url", help="gateway URL (default: from settings)")
    demo.add_argument("--aggregator-url", help="aggregator URL (default: from settings)")
    demo.add_argument("--requests", type=int, default=12, help="ShareGPT prompts to send")
    demo.add_argument("--halueval", type=int, default=4, help="HaluEval questions to send")
    demo.add_argument("--max-tokens", type=int, default=48)
    demo.add_argument("--key", help="API key, if the gateway requires one")
    demo.set_defaults(handler=run_demo)


def prompts(settings: Settings, sharegpt: int, halueval: int) -> list[str]:
    sharegpt_texts = corpora.load_texts("sharegpt", settings.cache_home)
    chats = [t for t in sharegpt_texts if len(t) < MAX_PROMPT_CHARS]
    questions = [item.question for item in corpora.halueval_items(settings.cache_home)]
    return chats[:sharegpt] + questions[:halueval]


def run_demo(args: argparse.Namespace, settings: Settings) -> int:
    url = args.url or f"http://127.0.0.1:{settings.gateway.port}"
    aggregator = args.aggregator_url or f"http://127.0.0.1:{settings.aggregator.port}"
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    texts = prompts(settings, args.requests, args.halueval)
    with httpx.Client(base_url=url, headers=headers, timeout=300) as client:
        try:
            client.get("/healthz").raise_for_status()
        except httpx.HTTPError as exc:
            raise OSError(f"no gateway at {url} ({exc}); start one with `make run`") from None
        levels = served_levels(client)
        emit(f"sending {len(texts)} real prompts to {url} at {', '.join(levels)}")
        for i, text in enumerate(texts, 1):
            emit(ask(client, text, levels[i % len(levels)], args.max_tokens, i))
        emit(summary(aggregator))
        emit(alerts(client))
    return 0


def served_levels(client: httpx.Client) -> list[str]:
    """The sparse levels the gateway has calibrations for, plus `auto` when it has them all."""
    reply = client.get("/v1/models")
    if reply.status_code in (401, 403):
        raise ValueError("the gateway wants an API key: pass --key")
    served = reply.json()["data"][0].get("ir_sparse_levels", [])
    levels = [level for level in SPARSE if level in served]
    if not levels:
        raise LookupError("the gateway serves no sparse level; run `sparseguard calibrate`")
    return ["auto", *levels] if len(levels) == len(SPARSE) else levels


def ask(client: httpx.Client, text: str, level: str, max_tokens: int, n: int) -> str:
    started = time.perf_counter()
    reply = client.post(
        "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens,
            "ir_sparse_level": level,
        },
    )
    seconds = time.perf_counter() - started
    prompt = text.replace("\n", " ")[:50]
    if reply.status_code != 200:
        return f"#{n:<3} {level:12} HTTP {reply.status_code}: {reply.text[:120]}"
    h = reply.headers
    answer = reply.json()["choices"][0]["message"]["content"].replace("\n", " ")[:60]
    return (
        f"#{n:<3} {h['x-ir-level']:12} sparsity {float(h['x-ir-sparsity']):.3f}  "
        f"trust {h['x-ir-trust']:<18} {seconds:5.1f} s  {prompt!r} -> {answer!r}"
    )


def summary(aggregator: str, wait_s: float = 10.0) -> str:
    """The aggregator's 5-minute windows once it has folded the demo's events."""
    deadline = time.monotonic() + wait_s
    keys: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        try:
            keys = httpx.get(f"{aggregator}/windows", timeout=5).json()["keys"]
        except (httpx.HTTPError, ValueError, KeyError):
            return f"(no aggregator at {aggregator}: windows not shown)"
        if keys:
            break
        time.sleep(1)
    lines = ["", "last 5 minutes, from the aggregator:"]
    lines.append(
        f"  {'level':12} {'requests':>8} {'sparsity':>9} {'gate conf':>9} "
        f"{'KL drift':>9}  trust actions"
    )
    for key in keys:
        w = key["windows"]["5m"]
        lines.append(
            f"  {key['level']:12} {w['requests']:>8} {_f(w['sparsity_mean']):>9} "
            f"{_f(w['gate_confidence_mean']):>9} {_f(w['drift_kl_mean']):>9}  "
            f"{w['trust_actions'] or '-'}"
        )
    return "\n".join(lines)


def alerts(client: httpx.Client) -> str:
    """The alerts firing now, from the gateway's status data."""
    reply = client.get("/status/data")
    if reply.status_code in (401, 403):
        return "alerts: the status data needs an admin key (--key)"
    if reply.status_code != 200:
        return f"alerts: not available (HTTP {reply.status_code})"
    firing = [a for a in reply.json()["alerts"] if a["state"] == "firing"]
    if not firing:
        return "alerts: none firing"
    lines = [f"alerts firing ({len(firing)}):"]
    for alert in firing:
        labels = ", ".join(f"{k}={v}" for k, v in sorted(alert["labels"].items()))
        lines.append(f"  {alert['severity']:8} {alert['name']:26} {labels}  value {alert['value']}")
    return "\n".join(lines)


def _f(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"
