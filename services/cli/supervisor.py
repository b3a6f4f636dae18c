"""Run a set of child processes as one service: start them together and wait until each is
ready, prefix and forward their output, restart a child that dies (a few times, then report
and give up), and stop them all, nothing left running, on request."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO

log = logging.getLogger(__name__)
Probe = Callable[["Child"], bool]


@dataclass(frozen=True, slots=True)
class ChildSpec:
    name: str
    command: list[str]
    ready: Probe  # True once the child serves
    ready_timeout_s: float = 180.0
    first: bool = False  # started, and ready, before the others (the broker they connect to)


@dataclass(slots=True)
class Child:
    spec: ChildSpec
    process: subprocess.Popen[bytes]
    output: deque[str] = field(default_factory=lambda: deque(maxlen=200))
    started_at: float = field(default_factory=time.monotonic)

    @property
    def name(self) -> str:
        return self.spec.name

    def exited(self) -> int | None:
        return self.process.poll()

    def said(self, text: str) -> bool:
        return any(text in line for line in list(self.output))

    def tail(self, lines: int = 20) -> str:
        return "\n".join(list(self.output)[-lines:])


class ChildFailedError(RuntimeError):
    """A child did not become ready, or kept dying."""


class Supervisor:
    def __init__(
        self,
        specs: Sequence[ChildSpec],
        env: dict[str, str],
        max_restarts: int = 3,
        restart_window_s: float = 300.0,
        sink: IO[str] | None = None,
    ) -> None:
        self.specs = list(specs)
        self.env = env
        self.max_restarts = max_restarts
        self.restart_window_s = restart_window_s
        self.sink = sink or sys.stderr
        self.children: dict[str, Child] = {}
        self.restarts: dict[str, deque[float]] = {s.name: deque() for s in self.specs}
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start every child at once (none needs another to be ready: they meet through the
        broker, the database and Redis), then wait until each is ready. Started one after the
        other, the four children of `sparseguard up` took 7.6-11.6 s each on 2 cores. Those
        marked `first` come up before the rest."""
        for wave in ([s for s in self.specs if s.first], [s for s in self.specs if not s.first]):
            for spec in wave:
                self._launch(spec)
            for spec in wave:
                self._wait_ready(self.children[spec.name])

    def watch(self, stop: threading.Event, every_s: float = 0.5) -> None:
        """Until `stop`: restart children that exit. Raises ChildFailedError when one exits
        more than `max_restarts` times within `restart_window_s`."""
        while not stop.wait(every_s):
            for child in list(self.children.values()):
                code = child.exited()
                if code is not None and not stop.is_set():
                    self._restart(child, code)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM every child (its whole process group), last started first; SIGKILL what is
        still running after `timeout_s`."""
        children = list(reversed(self.children.values()))
        for child in children:
            _signal_group(child.process, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in children:
            try:
                child.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s; killing it", child.name, timeout_s)
            _signal_group(child.process, signal.SIGKILL)  # stragglers in its group, if any
            child.process.wait()
        self.children.clear()

    def _launch(self, spec: ChildSpec) -> Child:
        process = subprocess.Popen(
            spec.command,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches only the supervisor, which stops all
        )
        child = Child(spec, process)
        self.children[spec.name] = child
        threading.Thread(target=self._forward, args=(child,), daemon=True).start()
        log.info("started %s (pid %d)", spec.name, process.pid)
        return child

    def _wait_ready(self, child: Child) -> None:
        deadline = time.monotonic() + child.spec.ready_timeout_s
        while not child.spec.ready(child):
            code = child.exited()
            if code is not None or time.monotonic() > deadline:
                why = f"exited with code {code}" if code is not None else "is not ready in time"
                raise ChildFailedError(f"{child.name} {why}; its last output:\n{child.tail()}")
            time.sleep(0.2)
        log.info("%s is ready (%.1f s)", child.name, time.monotonic() - child.started_at)

    def _restart(self, child: Child, code: int) -> None:
        recent = self.restarts[child.name]
        now = time.monotonic()
        while recent and now - recent[0] > self.restart_window_s:
            recent.popleft()
        if len(recent) >= self.max_restarts:
            raise ChildFailedError(
                f"{child.name} exited with code {code} {len(recent) + 1} times within "
                f"{self.restart_window_s:.0f} s; giving up. Its last output:\n{child.tail()}"
            )
        recent.append(now)
        log.warning(
            "%s exited with code %d; restarting (%d/%d)",
            child.name,
            code,
            len(recent),
            self.max_restarts,
        )
        self._wait_ready(self._launch(child.spec))

    def _forward(self, child: Child) -> None:
        """Copy the child's output to the sink line by line; close the pipe once it ends."""
        assert child.process.stdout is not None
        with child.process.stdout as stream:
            for raw in stream:
                line = raw.decode(errors="replace").rstrip()
                child.output.append(line)
                with self._lock:
                    self.sink.write(f"{child.name:>10} | {line}\n")
                    self.sink.flush()


def _signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)
