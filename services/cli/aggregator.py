"""`sparseguard aggregator`."""

from __future__ import annotations

import argparse
from typing import Any

from services.aggregator.service import run_aggregator
from services.config import Settings


def register(commands: Any) -> None:
    a = commands.add_parser(
        "aggregator", help="consume telemetry into rolling windows, metrics and SQL"
    )
    a.add_argument(
        "--port", type=int, help="HTTP port for /metrics and /windows (default: settings)"
    )
    a.add_argument("--bootstrap", help="Kafka bootstrap servers (default: settings)")
    a.set_defaults(handler=run)


def run(args: argparse.Namespace, settings: Settings) -> int:
    if args.port:
        settings.aggregator.port = args.port
    if args.bootstrap:
        settings.telemetry.bootstrap_servers = args.bootstrap
    run_aggregator(settings)
    return 0
