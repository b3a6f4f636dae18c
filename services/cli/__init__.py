"""The `sparseguard` command: one sub-command per verb."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from pydantic import ValidationError

from services.cli import (
    aggregator,
    alerts,
    bench,
    calibration,
    compress,
    dashboards,
    data,
    db,
    demo,
    eval_alerts,
    eval_reasons,
    finetune,
    gates,
    gateway,
    golden,
    jobs,
    kb,
    kernels,
    probe,
    quant_study,
    retrieval_study,
    silence,
    temperature_study,
    trust,
    trust_study,
    up,
)
from services.config import Settings
from services.telemetry.schema import summarize_validation

log = logging.getLogger("sparseguard")
Handler = Callable[[argparse.Namespace, Settings], int]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sparseguard", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (
        data,
        calibration,
        probe,
        bench,
        gateway,
        aggregator,
        alerts,
        db,
        jobs,
        golden,
        dashboards,
        up,
        demo,
        eval_alerts,
        eval_reasons,
        compress,
        silence,
        trust,
        trust_study,
        retrieval_study,
        temperature_study,
        kb,
        kernels,
        gates,
        finetune,
        quant_study,
    ):
        module.register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = Settings()
    except ValueError as exc:  # SPARSEGUARD_* settings that do not validate
        sys.stderr.write(f"sparseguard: error: {exc}\n")
        return 2
    logging.basicConfig(
        level="DEBUG" if args.verbose else settings.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not args.verbose:  # client libraries log every request and rebalance at INFO
        for noisy in ("kafka", "httpx"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    handler: Handler = args.handler
    try:
        return handler(args, settings)
    except ValidationError as exc:  # a spec built from the arguments: name the field, no URL
        log.debug("command failed", exc_info=True)
        sys.stderr.write(f"sparseguard: error: {summarize_validation(exc)}\n")
        return 2
    except (ValueError, LookupError, OSError) as exc:
        log.debug("command failed", exc_info=True)
        sys.stderr.write(f"sparseguard: error: {exc}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("sparseguard: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
