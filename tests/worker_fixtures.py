"""Real Celery worker and beat processes (`sparseguard worker|beat`) for integration tests,
configured through the environment like a deployment, with logs kept for failures."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

SPARSEGUARD = Path(sys.executable).with_name("sparseguard")


def job_env(state: Path, cache: Path, **settings: str | int | float) -> dict[str, str]:
    """Environment for a SparseGuard process: state under `state`, downloads from `cache`, a
    queue of its own (so concurrent test runs never share one), and `settings` as
    SPARSEGUARD_<SECTION>__<NAME> variables, e.g. jobs__broker_url=..."""
    env = {
        **os.environ,
        "SPARSEGUARD_HOME": str(state),
        "SPARSEGUARD_CACHE_DIR": str(cache),
        "SPARSEGUARD_JOBS__QUEUE": f"sg-test-{uuid.uuid4().hex[:8]}",
        "SPARSEGUARD_ENGINE__THREADS": "1",
        # Small enough for CI: a recalibration of one level takes seconds, not minutes.
        "SPARSEGUARD_ENGINE__CALIBRATION_SAMPLES": "8",
        "SPARSEGUARD_ENGINE__HELDOUT_TOKENS": "512",
        "SPARSEGUARD_ENGINE__SENSITIVITY_TOKENS": "64",
        # and its baseline pass a couple of requests per kind of traffic, a few tokens each
        "SPARSEGUARD_ENGINE__BASELINE_REQUESTS": "10",
        "SPARSEGUARD_ENGINE__BASELINE_MAX_NEW_TOKENS": "4",
        # and a trust fit's flag thresholds a few healthy chat answers per level
        "SPARSEGUARD_TRUST__FLAG_REQUESTS": "20",
    }
    env.update({f"SPARSEGUARD_{key.upper()}": str(value) for key, value in settings.items()})
    return env


class Process:
    """One `sparseguard` command in its own process group, its output in a log file."""

    def __init__(self, args: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self._out = log.open("ab")
        self.proc = subprocess.Popen(
            [str(SPARSEGUARD), *args],
            env=env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def output(self) -> str:
        if not self._out.closed:
            self._out.flush()
        return self.log.read_text(errors="replace")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the whole group, as when a container dies: no clean-up runs."""
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        self._out.close()

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._out.close()


def started(args: list[str], env: dict[str, str], log: Path) -> Iterator[Process]:
    process = Process(args, env, log)
    try:
        yield process
    finally:
        process.stop()
