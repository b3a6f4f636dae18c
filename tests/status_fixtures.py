"""Headless Chromium (the Debian binary) for the status page tests: the DOM after the page's
scripts ran, a screenshot, a small parsed tree to assert on what was rendered, and a tab driven
over the DevTools protocol (on a pipe, no extra packages) for what needs typing."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from services.storage.db import upgrade
from tests.service_fixtures import PG_ADMIN, postgres_admin

log = logging.getLogger(__name__)

CHROMIUM = Path("/usr/bin/chromium")
REPO = Path(__file__).resolve().parent.parent
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"}
FLAGS = (
    "--headless",
    "--no-sandbox",  # tests may run as root in a container
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--hide-scrollbars",
    "--run-all-compositor-stages-before-draw",  # complete screenshots, not half-painted
)
# Enough virtual time for the first fetch and render; the 10 s refresh never fires.
VIRTUAL_TIME = "--virtual-time-budget=5000"

needs_chromium = pytest.mark.skipif(
    not CHROMIUM.exists(),
    reason=f"{CHROMIUM} is missing: apt-get install chromium to run the status page in a browser",
)


def artifacts_dir() -> Path:
    configured = os.environ.get("SPARSEGUARD_TEST_ARTIFACTS")
    path = Path(configured) if configured else REPO / ".artifacts"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _chromium(profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Headless Chromium on the page; a run that hangs (seen once in many CI runs here, on a
    page that rendered in seconds before and after) is killed and tried once more with a fresh
    profile. Two hangs in a row fail the test."""
    for attempt in (1, 2):
        user_data = profile if attempt == 1 else profile.with_name(profile.name + "-retry")
        command = [str(CHROMIUM), *FLAGS, VIRTUAL_TIME, f"--user-data-dir={user_data}", *args]
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=90, check=True)
        except subprocess.TimeoutExpired:
            if attempt == 2:
                raise
            log.warning("chromium hung for 90 s; trying once more with a fresh profile")
    raise AssertionError("unreachable")


def dump_dom(url: str, profile: Path) -> Element:
    """The page's DOM once its scripts have run, parsed."""
    return parse(_chromium(profile, "--dump-dom", url).stdout)


def screenshot(url: str, path: Path, profile: Path, size: str = "1280,1600") -> Path:
    _chromium(profile, f"--screenshot={path}", f"--window-size={size}", url)
    return path


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    children: list[Element] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)

    def walk(self) -> Iterator[Element]:
        yield self
        for child in self.children:
            yield from child.walk()

    def find_all(self, tag: str | None = None, **attrs: str | None) -> list[Element]:
        """Descendants (and self) with that tag and attributes; a value of None only asks
        that the attribute is present. Attribute names use _ for -."""
        wanted = {name.replace("_", "-"): value for name, value in attrs.items()}
        return [e for e in self.walk() if (tag is None or e.tag == tag) and e.has(wanted)]

    def find(self, tag: str | None = None, **attrs: str | None) -> Element:
        (found,) = self.find_all(tag, **attrs)
        return found

    def has(self, wanted: dict[str, str | None]) -> bool:
        return all(
            name in self.attrs and (value is None or self.attrs[name] == value)
            for name, value in wanted.items()
        )

    def text(self) -> str:
        """All text below, whitespace collapsed."""
        parts = [t for e in self.walk() for t in e.texts]
        return " ".join(" ".join(parts).split())

    def rows(self) -> list[Element]:
        """A table's body rows."""
        return [row for body in self.find_all("tbody") for row in body.find_all("tr")]


class _TreeBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.root = Element("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = Element(tag, {name: value or "" for name, value in attrs})
        self.stack[-1].children.append(element)
        if tag not in VOID:
            self.stack.append(element)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.stack[-1].children.append(Element(tag, {name: value or "" for name, value in attrs}))

    def handle_endtag(self, tag: str) -> None:
        for depth in range(len(self.stack) - 1, 0, -1):
            if self.stack[depth].tag == tag:
                del self.stack[depth:]
                return

    def handle_data(self, data: str) -> None:
        if self.stack[-1].tag not in ("script", "style"):
            self.stack[-1].texts.append(data)


def parse(html: str) -> Element:
    builder = _TreeBuilder()
    builder.feed(html)
    builder.close()
    return builder.root


class Tab:
    """One page of a headless Chromium driven over --remote-debugging-pipe: commands go to its
    fd 3 and replies come from its fd 4, as NUL-terminated JSON."""

    def __init__(self, to_browser: int, from_browser: int) -> None:
        self._out, self._in = to_browser, from_browser
        self._ids = 0
        self._buffer = b""
        self._session: str | None = None
        targets = self.send("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        attached = self.send("Target.attachToTarget", targetId=page["targetId"], flatten=True)
        self._session = attached["sessionId"]

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        self._ids += 1
        message: dict[str, Any] = {"id": self._ids, "method": method, "params": params}
        if self._session is not None:
            message["sessionId"] = self._session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        while True:  # events and other replies are skipped
            reply = self._receive()
            if reply.get("id") == self._ids:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                result: dict[str, Any] = reply["result"]
                return result

    def _receive(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            chunk = os.read(self._in, 1 << 16)
            if not chunk:
                raise RuntimeError("chromium closed the DevTools pipe")
            self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        message: dict[str, Any] = json.loads(raw)
        return message

    def evaluate(self, expression: str) -> Any:
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 15.0) -> None:
        """Until `expression` is truthy (an error, as while a page loads, counts as false)."""
        guarded = f"(() => {{ try {{ return !!({expression}); }} catch {{ return false; }} }})()"
        deadline = time.monotonic() + timeout_s
        while not self.evaluate(guarded):
            if time.monotonic() > deadline:
                raise TimeoutError(f"page never satisfied: {expression}")
            time.sleep(0.05)


def _high_pipe() -> tuple[int, int]:
    """A pipe whose ends are above fd 9, so placing them at 3 and 4 never overwrites one."""
    ends = os.pipe()
    high = tuple(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in ends)
    for fd in ends:
        os.close(fd)
    return high[0], high[1]


@contextmanager
def browser_tab(profile: Path) -> Iterator[Tab]:
    commands_r, commands_w = _high_pipe()
    replies_r, replies_w = _high_pipe()

    def on_fds_3_and_4() -> None:  # in the child, before exec
        os.dup2(commands_r, 3)
        os.dup2(replies_w, 4)

    process = subprocess.Popen(
        [str(CHROMIUM), *FLAGS, "--remote-debugging-pipe", f"--user-data-dir={profile}"],
        pass_fds=(3, 4),
        preexec_fn=on_fds_3_and_4,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    os.close(commands_r)
    os.close(replies_w)
    try:
        yield Tab(commands_w, replies_r)
    finally:
        process.terminate()
        process.wait(30)
        os.close(commands_w)
        os.close(replies_r)


@contextmanager
def migrated_database(kind: str, tmp_path: Path) -> Iterator[str]:
    """The URL of a migrated SQLite file or temporary PostgreSQL database (skipped when
    PostgreSQL is unreachable, failed under CI), as the storage tests use."""
    if kind == "sqlite":
        url = f"sqlite:///{tmp_path / 'status.db'}"
        upgrade(url)
        yield url
        return
    name = f"sg_status_{secrets.token_hex(6)}"
    with postgres_admin() as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
        try:
            url = f"{PG_ADMIN.rsplit('/', 1)[0]}/{name}"
            upgrade(url)
            yield url
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
