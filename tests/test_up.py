"""`sparseguard up` as a user runs it: the whole embedded stack in child processes, real
traffic and `sparseguard demo` through it, a killed child restarted, and Ctrl-C leaving nothing
running. The supervisor's restart and give-up rules on plain child processes."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from services.cli.supervisor import ChildFailedError, ChildSpec, Supervisor
from services.shared.serving import free_port
from services.telemetry.broker import accepts_connections
from sparse_engine.calibration.store import CalibrationStore
from tests.polling import wait_until
from tests.worker_fixtures import SPARSEGUARD, job_env

STARTED = re.compile(r"started (\w+) \(pid (\d+)\)")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def window_sources(port: int) -> set[str]:
    """Where the balanced 5-minute window's gate-confidence reference comes from."""
    keys = httpx.get(f"http://127.0.0.1:{port}/windows", timeout=5).json()["keys"]
    return {
        key["windows"]["5m"]["references"]["gate_confidence"]["source"]
        for key in keys
        if key["level"] == "balanced"
    }


def balanced_requests(port: int) -> int:
    """Requests in the balanced 1-hour window (the test's traffic all falls in it)."""
    keys = httpx.get(f"http://127.0.0.1:{port}/windows", timeout=5).json()["keys"]
    return sum(k["windows"]["1h"]["requests"] for k in keys if k["level"] == "balanced")


@pytest.mark.slow
def test_up_runs_the_stack_restarts_a_crashed_child_and_stops_cleanly(
    home: Path, calibrated_store: CalibrationStore, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    for cal in calibrated_store.list():
        CalibrationStore(state / "calibrations").save(cal)
    ports = {"gateway": free_port(), "aggregator": free_port(), "broker": free_port()}
    env = job_env(
        state,
        home,
        gateway__port=ports["gateway"],
        aggregator__port=ports["aggregator"],
        telemetry__bootstrap_servers=f"127.0.0.1:{ports['broker']}",
        aggregator__snapshot_interval_s=2,
    )
    out, err = (tmp_path / "up.out").open("w+"), (tmp_path / "up.err").open("w+")
    up = subprocess.Popen([str(SPARSEGUARD), "up"], env=env, stdout=out, stderr=err)
    gateway = f"http://127.0.0.1:{ports['gateway']}"
    try:
        wait_until(lambda: "SparseGuard is up" in (tmp_path / "up.out").read_text(), 240, 0.5)
        assert f"status page  {gateway}/status" in (tmp_path / "up.out").read_text()
        reply = httpx.post(
            f"{gateway}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
            timeout=60,
        )
        assert reply.status_code == 200 and reply.headers["x-ir-level"] == "balanced"
        demo = subprocess.run(
            [str(SPARSEGUARD), "demo", "--requests", "3", "--halueval", "1", "--max-tokens", "8"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert demo.returncode == 0, demo.stderr
        assert len(re.findall(r"^#\d+ +\w+ +sparsity 0\.\d{3}", demo.stdout, re.M)) == 4
        assert "last 5 minutes, from the aggregator" in demo.stdout
        assert re.search(r"^alerts: none firing$|^alerts firing \(\d+\):$", demo.stdout, re.M)

        # The session's calibration has no baseline: `up` queued the baseline job, whose
        # measurement reaches the artefact, and the aggregator's window rules then test
        # against it (re-read at its next snapshot) instead of the published numbers.
        balanced = CalibrationStore(state / "calibrations")
        wait_until(lambda: all(c.baseline is not None for c in balanced.list()), 180, 1.0)
        assert "job 1 measures it on the worker" in Path(err.name).read_text()
        wait_until(lambda: window_sources(ports["aggregator"]) == {"baseline"}, 90, 1.0)

        log = Path(err.name)
        pids = {name: int(pid) for name, pid in STARTED.findall(log.read_text())}
        assert set(pids) == {"broker", "gateway", "aggregator", "worker", "beat"}
        os.kill(pids["aggregator"], signal.SIGKILL)
        wait_until(
            lambda: (
                "aggregator exited with code -9; restarting (1/3)" in Path(err.name).read_text()
            ),
            30,
            0.2,
        )
        wait_until(lambda: Path(err.name).read_text().count("aggregator is ready") == 2, 60, 0.2)

        # The broker dies: it comes back on the same address, empty; the aggregator makes the
        # topics again and the next request's event reaches its windows.
        before = balanced_requests(ports["aggregator"])
        os.kill(pids["broker"], signal.SIGKILL)
        wait_until(lambda: Path(err.name).read_text().count("broker is ready") == 2, 60, 0.2)
        assert "broker exited with code -9; restarting (1/3)" in Path(err.name).read_text()
        after_restart = httpx.post(
            f"{gateway}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi again"}], "max_tokens": 4},
            timeout=60,
        )
        assert after_restart.status_code == 200
        wait_until(lambda: balanced_requests(ports["aggregator"]) > before, 90, 1.0)
        children = [
            int(pid)
            for _, pid in re.findall(r"started (\w+) \(pid (\d+)\)", Path(err.name).read_text())
        ]
    finally:
        up.send_signal(signal.SIGINT)  # Ctrl-C
        code = up.wait(60)
        out.close()
        err.close()
    assert code == 0
    assert "stopped; nothing left running" in (tmp_path / "up.out").read_text()
    assert [pid for pid in children if alive(pid)] == []
    assert not any(accepts_connections(port) for port in ports.values())


def test_supervisor_restarts_a_dying_child_then_gives_up(tmp_path: Path) -> None:
    marker = tmp_path / "runs"
    dies = (
        "import pathlib, sys, time; p = pathlib.Path(sys.argv[1]); "
        "p.write_text(p.read_text() + 'x' if p.exists() else 'x'); print('up', flush=True); "
        "time.sleep(0.3); sys.exit(3)"
    )
    spec = ChildSpec("flaky", [sys.executable, "-c", dies, str(marker)], lambda c: c.said("up"), 10)
    supervisor = Supervisor([spec], dict(os.environ), max_restarts=2, restart_window_s=60)
    stop = threading.Event()
    try:
        supervisor.start()
        with pytest.raises(ChildFailedError, match="flaky exited with code 3 3 times"):
            supervisor.watch(stop, every_s=0.05)
    finally:
        supervisor.stop()
    assert marker.read_text() == "xxx"  # the first run and two restarts


def test_supervisor_reports_a_child_that_never_gets_ready_and_stops_it(tmp_path: Path) -> None:
    hangs = "import time; print('starting', flush=True); time.sleep(60)"
    spec = ChildSpec("stuck", [sys.executable, "-c", hangs], lambda c: False, 1.0)
    supervisor = Supervisor([spec], dict(os.environ))
    with pytest.raises(ChildFailedError, match="stuck is not ready in time") as error:
        supervisor.start()
    assert "starting" in str(error.value)  # its last output
    pid = supervisor.children["stuck"].process.pid
    started = time.monotonic()
    supervisor.stop(timeout_s=5)
    assert not alive(pid) and time.monotonic() - started < 5
