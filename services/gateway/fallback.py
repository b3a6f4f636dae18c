"""Guardrail actions on a low-trust answer: which one a route takes, the knowledge base it
searches (opened on first use), and the prompts it regenerates with."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.config import ROUTE_PATHS, Settings
from services.gateway.inputs import ChatInput
from services.storage.kb import Hit, search

if TYPE_CHECKING:
    from sqlalchemy import Engine as SqlEngine
    from sqlalchemy.orm import Session, sessionmaker

ROUTES = dict(zip(("chat", "completions", "messages"), ROUTE_PATHS, strict=True))
SIMPLIFY = "Answer in more basic language."
RETRIEVED = "Use these passages from the knowledge base if they help you answer."


def route_action(settings: Settings, chat: ChatInput) -> str:
    """The action configured for the request's route: retrieve, simplify or flag. A streamed
    answer is already on its way to the client, so it can only be flagged; so is a legacy
    completion, whose raw prompt has no question to simplify or to add passages to."""
    action = settings.trust.actions.get(ROUTES[chat.endpoint], settings.trust.default_action)
    return "flag" if chat.stream or chat.raw else action


class KnowledgeBase:
    """Full-text search over the SQL store's knowledge base; thread-safe, connects lazily."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._opened: tuple[SqlEngine, sessionmaker[Session]] | None = None

    def search(self, query: str, k: int) -> list[Hit]:
        with self._sessions()() as session:
            return search(session, query, k)

    def _sessions(self) -> sessionmaker[Session]:
        from services.storage.db import make_engine, session_factory, upgrade

        with self._lock:
            if self._opened is None:
                upgrade(self._settings.database_url)
                engine = make_engine(self._settings.database_url)
                self._opened = engine, session_factory(engine)
            return self._opened[1]

    def close(self) -> None:
        with self._lock:
            if self._opened is not None:
                self._opened[0].dispose()
                self._opened = None


def with_passages(
    messages: list[dict[str, str]], hits: list[Hit], max_chars: int
) -> list[dict[str, str]]:
    """The messages with the passages put before the last user turn's text."""
    numbered = "\n".join(
        f"[{i}] {(h.title + ': ') if h.title else ''}{h.text[:max_chars]}"
        for i, h in enumerate(hits, 1)
    )
    return _amend_last_user(messages, lambda text: f"{RETRIEVED}\n\n{numbered}\n\n{text}")


def simplified(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    return _amend_last_user(messages, lambda text: f"{text}\n\n{SIMPLIFY}")


def _amend_last_user(
    messages: list[dict[str, str]], amend: Callable[[str], str]
) -> list[dict[str, str]]:
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    last = users[-1] if users else len(messages) - 1
    out = [dict(m) for m in messages]
    out[last]["content"] = amend(out[last]["content"])
    return out
