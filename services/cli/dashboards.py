"""`sparseguard dashboards`: write the Grafana dashboards' JSON, upload them to a Grafana."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dashboards import JSON_DIR, dashboards, write_all
from dashboards.push import TIMEOUT_S, push
from services.cli.common import emit
from services.config import Settings


def register(commands: Any) -> None:
    d = commands.add_parser("dashboards", help="Grafana dashboards: generate JSON, push")
    verbs = d.add_subparsers(dest="dashboards_command", required=True, metavar="VERB")
    generate = verbs.add_parser("generate", help="write the dashboards as JSON files")
    generate.add_argument("--out", type=Path, default=JSON_DIR, help="output folder")
    generate.set_defaults(handler=run_generate)
    upload = verbs.add_parser("push", help="upload the dashboards to a Grafana (overwrite)")
    upload.add_argument("--grafana-url", required=True, help="e.g. http://localhost:3000")
    upload.add_argument("--token", required=True, help="Grafana service account token (Editor)")
    upload.add_argument("--folder", default="SparseGuard", help="folder, created if missing")
    upload.add_argument("--timeout", type=float, default=TIMEOUT_S, help="seconds per request")
    upload.set_defaults(handler=run_push)


def run_generate(args: argparse.Namespace, settings: Settings) -> int:
    for path in write_all(args.out, settings.signals, settings.trust):
        emit(str(path))
    return 0


def run_push(args: argparse.Namespace, settings: Settings) -> int:
    found = [dashboard.to_json() for dashboard in dashboards(settings.signals, settings.trust)]
    for uid, url in push(found, args.grafana_url, args.token, args.folder, args.timeout):
        emit(f"{uid} {url}")
    return 0
