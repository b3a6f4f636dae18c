"""Versioned JSON artefacts: one `<root>/<version>.json` file each, written atomically, named
`<prefix>-<UTC time>-<content hash>` so versions sort by time and are unique by content.
`CalibrationStore` and `TrustStore` are thin typed users of `JsonStore`."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any


def write_json_atomic(path: Path, data: Any) -> None:
    """Write `data` as JSON to `path` through a synced temporary file: a crash never leaves a
    partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def stamped_version(prefix: str, created_at: str, content: Any) -> str:
    """`<prefix>-<UTC time of created_at>-<first 8 hex of the content's sha256>`."""
    stamp = datetime.fromisoformat(created_at).strftime("%Y%m%dT%H%M%S")
    body = json.dumps(content, sort_keys=True)
    return f"{prefix}-{stamp}-{hashlib.sha256(body.encode()).hexdigest()[:8]}"


class JsonStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def save(self, version: str, data: dict[str, Any]) -> None:
        write_json_atomic(self.root / f"{version}.json", data)

    def load(self, version: str) -> dict[str, Any] | None:
        path = self.root / f"{version}.json"
        return _read(path) if path.is_file() else None

    def all(self, pattern: str = "*.json") -> list[dict[str, Any]]:
        return [_read(p) for p in self.root.glob(pattern)] if self.root.is_dir() else []


def _read(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data
