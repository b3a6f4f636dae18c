"""`sparseguard db upgrade|current`: migrate the configured database, or say where it is."""

from __future__ import annotations

import argparse
from typing import Any

from sqlalchemy.exc import OperationalError

from services.cli.common import emit
from services.config import Settings
from services.storage.db import current_revision, masked_url, upgrade


def register(commands: Any) -> None:
    db = commands.add_parser("db", help="the SQL database").add_subparsers(
        dest="action", required=True
    )
    db.add_parser("upgrade", help="migrate the database to the newest schema").set_defaults(
        handler=upgrade_database
    )
    db.add_parser("current", help="show the revision the database is at").set_defaults(
        handler=show_revision
    )


def upgrade_database(args: argparse.Namespace, settings: Settings) -> int:
    url = settings.database_url
    try:
        upgrade(url)
        revision = current_revision(url)
    except OperationalError as exc:
        raise OSError(f"cannot migrate {masked_url(url)}: {exc.orig}") from exc
    emit(f"{masked_url(url)}: at revision {revision}")
    return 0


def show_revision(args: argparse.Namespace, settings: Settings) -> int:
    url = settings.database_url
    try:
        revision = current_revision(url)
    except OperationalError as exc:
        raise OSError(f"cannot reach {masked_url(url)}: {exc.orig}") from exc
    emit(f"{masked_url(url)}: at revision {revision or 'none (run `sparseguard db upgrade`)'}")
    return 0
