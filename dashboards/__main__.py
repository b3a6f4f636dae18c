"""`python -m dashboards [--out DIR]`: write the dashboards' JSON (default: dashboards/json)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from dashboards import JSON_DIR, write_all


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboards", description=__doc__)
    parser.add_argument("--out", type=Path, default=JSON_DIR, help="output folder")
    for path in write_all(parser.parse_args(argv).out):
        sys.stdout.write(f"{path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
