"""The golden-set file: JSONL of {"id", "prompt", "reference", "source", "metric"}, read with
errors that name the line, written atomically; and prompt files for `sparseguard golden create`.

`metric` says how an answer is scored against the reference: "f1" (token F1, for short
answers), "chrf" (for long ones) or "bleu" (sentence BLEU-4). It is optional, for files written
before it existed: a reference of at most SHORT_ANSWER_WORDS words is scored with F1, a longer
one with chrF."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METRICS = ("f1", "chrf", "bleu")
SHORT_METRIC, LONG_METRIC = "f1", "chrf"
SHORT_ANSWER_WORDS = 8


@dataclass(frozen=True, slots=True)
class GoldenItem:
    id: str
    prompt: str
    reference: str
    source: str = "unknown"  # "gpt-4", "halueval", "dense:<model_id>", or what the file says
    metric: str = ""  # one of METRICS; "" means the default for the reference

    def __post_init__(self) -> None:
        if not self.metric:
            object.__setattr__(self, "metric", default_metric(self.reference))
        elif self.metric not in METRICS:
            raise ValueError(
                f"golden item {self.id!r}: unknown metric {self.metric!r}; "
                f"choose one of: {', '.join(METRICS)}"
            )


def default_metric(reference: str) -> str:
    """F1 for a short reference (a few words: a factual answer), chrF for a longer one."""
    return SHORT_METRIC if len(reference.split()) <= SHORT_ANSWER_WORDS else LONG_METRIC


def load_golden(path: Path) -> list[GoldenItem]:
    """Items of a JSONL file with "id", "prompt", "reference" (and optional "source" and
    "metric")."""
    items = [_item(row, where) for where, row in _jsonl(path)]
    _check_items(items, str(path))
    return items


def _item(row: dict[str, Any], where: str) -> GoldenItem:
    metric = _text(row, "metric", where) if "metric" in row else ""
    if metric and metric not in METRICS:
        raise ValueError(f'{where}: "metric" must be one of {", ".join(METRICS)}, got {metric!r}')
    return GoldenItem(
        id=_id(row, where),
        prompt=_text(row, "prompt", where),
        reference=_text(row, "reference", where, allow_empty=True),
        source=_text(row, "source", where) if "source" in row else "unknown",
        metric=metric,
    )


def write_golden(path: Path, items: Sequence[GoldenItem]) -> None:
    """Write items as JSONL atomically: readers see the old file or the new one, never half."""
    _check_items(items, str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            for item in items:
                out.write(json.dumps(_row(item), ensure_ascii=False) + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _row(item: GoldenItem) -> dict[str, str]:
    return {
        "id": item.id,
        "prompt": item.prompt,
        "reference": item.reference,
        "source": item.source,
        "metric": item.metric,
    }


def read_prompts(path: Path) -> list[tuple[str, str]]:
    """(id, prompt) pairs from a .jsonl file with a "prompt" (and optional "id") per line, or
    from a text file with one prompt per line; ids default to `<file stem>-<n>`."""
    if not path.is_file():
        raise FileNotFoundError(
            f'prompt file {path} not found; give a .jsonl file with a "prompt" field per line '
            "or a text file with one prompt per line"
        )
    if path.suffix == ".jsonl":
        rows = [
            (_id(row, where) if "id" in row else None, _text(row, "prompt", where))
            for where, row in _jsonl(path)
        ]
    else:
        lines = path.read_text(encoding="utf-8").splitlines()
        rows = [(None, line.strip()) for line in lines if line.strip()]
    prompts = [(pid or f"{path.stem}-{n}", prompt) for n, (pid, prompt) in enumerate(rows, start=1)]
    _check_ids([pid for pid, _ in prompts], str(path))
    return prompts


def _jsonl(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """("file:line", object) for each non-blank line."""
    for num, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{num}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        yield where, row


def _id(row: dict[str, Any], where: str) -> str:
    """An item id: a non-empty string, or an integer (as MT-Bench's question ids are)."""
    value = row.get("id")
    is_int = isinstance(value, int) and not isinstance(value, bool)
    return str(value) if is_int else _text(row, "id", where)


def _text(row: dict[str, Any], key: str, where: str, allow_empty: bool = False) -> str:
    value = row.get(key)
    if not isinstance(value, str) or not (value.strip() or allow_empty):
        raise ValueError(f'{where}: "{key}" must be a non-empty string, got {value!r}')
    return value


def _check_items(items: Sequence[GoldenItem], name: str) -> None:
    if not items:
        raise ValueError(f"golden set {name} has no items; it needs at least one prompt")
    _check_ids([item.id for item in items], name)


def _check_ids(ids: list[str], name: str) -> None:
    if not ids:
        raise ValueError(f"{name} holds no prompts")
    seen: set[str] = set()
    for pid in ids:
        if pid in seen:
            raise ValueError(f"{name}: duplicate id {pid!r}; every item needs its own id")
        seen.add(pid)
