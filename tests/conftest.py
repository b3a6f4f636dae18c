"""Shared test fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def home() -> Path:
    """The cache of real packages and models shared by slow tests across runs:
    $SPARSEGUARD_HOME if set, else ~/.cache/sparseguard (fetching them is slow)."""
    configured = os.environ.get("SPARSEGUARD_HOME")
    path = Path(configured).expanduser() if configured else Path.home() / ".cache" / "sparseguard"
    path.mkdir(parents=True, exist_ok=True)
    return path
