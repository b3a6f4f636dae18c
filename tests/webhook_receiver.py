"""A real webhook receiver on loopback for the delivery tests: verifies every Standard Webhooks
signature against a test-driven clock and answers as told (500 a few times, 410, slowly)."""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request, Response

from alerts.signing import SignatureError, verify
from services.storage.models import AlertRecord

T0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
EXTERNAL_URL = "http://sparseguard.example:8001"
SECRETS = {
    name: "whsec_" + base64.b64encode(f"{name}-key-0123456789abcdef".encode()).decode()
    for name in ("ops", "gone", "down", "slow", "ghost")
}


@dataclass
class Clock:
    now: datetime = T0

    def __call__(self) -> datetime:
        return self.now


@dataclass
class Hit:
    receiver: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class Receivers:
    """The far side: what each receiver answers next, and what it was sent."""

    clock: Clock = field(default_factory=Clock)
    answers: dict[str, list[int]] = field(default_factory=dict)  # then 200
    error_body: str = "internal error"
    delay_s: float = 0.0
    hits: list[Hit] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)

    def status_for(self, name: str) -> int:
        """The next planned answer; the last one repeats."""
        queue = self.answers.get(name, [])
        return queue.pop(0) if len(queue) > 1 else (queue[0] if queue else 200)

    def sent_to(self, name: str) -> list[Hit]:
        return [hit for hit in self.hits if hit.receiver == name]


@dataclass
class Slot:
    """The far side of the current test: one server serves the module, each test a fresh
    state (a request still running from an earlier test keeps writing to its own)."""

    current: Receivers = field(default_factory=Receivers)


def receiver_app(slot: Slot) -> FastAPI:
    app = FastAPI()

    @app.post("/hooks/{name}")
    async def hook(name: str, request: Request) -> Response:
        state = slot.current
        body = await request.body()
        await asyncio.sleep(state.delay_s)
        try:
            verify(SECRETS[name], request.headers, body, state.clock())
        except SignatureError as exc:
            state.rejected.append(str(exc))
            return Response(status_code=401)
        state.hits.append(Hit(name, dict(request.headers), json.loads(body)))
        status = state.status_for(name)
        return Response(state.error_body if status >= 300 else None, status_code=status)

    return app


def alert_record(fingerprint: str) -> AlertRecord:
    return AlertRecord(
        fingerprint=fingerprint,
        name="SparsityCollapse",
        state="firing",
        severity="warning",
        labels={},
        annotations={},
        starts_at=T0,
    )
