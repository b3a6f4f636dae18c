"""`sparseguard gateway` (serve the API) and `sparseguard keys hash`."""

from __future__ import annotations

import argparse
from typing import Any

import uvicorn

from services.cli.common import emit
from services.config import Settings
from services.gateway.app import create_app
from services.gateway.auth import hash_key


def register(commands: Any) -> None:
    g = commands.add_parser("gateway", help="serve the OpenAI/Anthropic-compatible API")
    g.add_argument("--host", help="bind address (default: settings)")
    g.add_argument("--port", type=int, help="port (default: settings)")
    g.add_argument("--mode", choices=["serve", "proxy"], help="serve the model or proxy upstream")
    g.add_argument("--upstream", help="upstream OpenAI-compatible base URL (proxy mode)")
    g.set_defaults(handler=run_gateway)
    keys = commands.add_parser("keys", help="API keys").add_subparsers(dest="action", required=True)
    h = keys.add_parser(
        "hash", help="print the sha256 to put in SPARSEGUARD_GATEWAY__API_KEY_HASHES"
    )
    h.add_argument("key")
    h.set_defaults(handler=run_hash)


def run_gateway(args: argparse.Namespace, settings: Settings) -> int:
    overrides = {
        k: v for k, v in (("host", args.host), ("port", args.port), ("mode", args.mode)) if v
    }
    if args.upstream:
        overrides["upstream_url"] = args.upstream
    settings = settings.model_copy(
        update={"gateway": settings.gateway.model_copy(update=overrides)}
    )
    if settings.gateway.mode == "proxy" and not settings.gateway.upstream_url:
        raise ValueError("proxy mode needs --upstream URL (or SPARSEGUARD_GATEWAY__UPSTREAM_URL)")
    app = create_app(settings)
    uvicorn.run(app, host=settings.gateway.host, port=settings.gateway.port, log_config=None)
    return 0


def run_hash(args: argparse.Namespace, settings: Settings) -> int:
    emit(hash_key(args.key))
    return 0
