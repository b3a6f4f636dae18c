"""`sparseguard kernels build`: compile the fast path's C++ kernels into the cache (the
install runs it; the engine would otherwise build them on first use)."""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

from services.cli.common import emit
from services.config import Settings
from sparse_engine.runtime import kernels

log = logging.getLogger(__name__)


def register(commands: Any) -> None:
    k = commands.add_parser("kernels", help="the fast decode path's compiled kernels")
    sub = k.add_subparsers(dest="kernels_command", required=True)
    b = sub.add_parser("build", help="compile them into the cache (about a minute, once)")
    b.set_defaults(handler=run_build)


def run_build(args: argparse.Namespace, settings: Settings) -> int:
    log.info("compiling %s (about a minute on 2 cores; cached after)", kernels.SOURCE.name)
    started = time.perf_counter()
    try:
        module = kernels.build()
    except kernels.KernelUnavailableError as exc:
        raise OSError(
            f"{exc}. Install a C++ compiler (apt-get install g++) and rerun "
            "`sparseguard kernels build`; until then the fast path uses its PyTorch fallback"
        ) from exc
    emit(f"kernels ready: {module.__file__} ({time.perf_counter() - started:.1f} s)")
    return 0
