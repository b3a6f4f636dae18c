"""The durable local spool: Kafka records as append-only JSON-lines segment files, fsynced on
write, bounded in bytes (the oldest segment goes first), read back oldest first for replay."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple

log = logging.getLogger(__name__)

SEGMENT_MAX_BYTES = 4 * 1024 * 1024
_SEGMENT_RE = re.compile(r"^segment-(\d{12})\.jsonl$")


class OutgoingRecord(NamedTuple):
    topic: str
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]


@dataclass(slots=True)
class Segment:
    seq: int
    path: Path
    num_bytes: int = 0
    num_records: int = 0
    num_acked: int = 0  # records of this segment already acknowledged (this process only)


def encode(record: OutgoingRecord) -> bytes:
    # surrogateescape keeps any bytes; the records we write are UTF-8 anyway.
    line = {
        "topic": record.topic,
        "key": _text(record.key),
        "value": _text(record.value),
        "headers": [[name, _text(value)] for name, value in record.headers],
    }
    return json.dumps(line, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes) -> OutgoingRecord:
    """Raises ValueError for a line that is not a spooled record (e.g. torn by a crash)."""
    try:
        data: Any = json.loads(line)
        headers = [(str(name), _bytes(value)) for name, value in data["headers"]]
        return OutgoingRecord(
            str(data["topic"]), _bytes(data["key"]), _bytes(data["value"]), headers
        )
    except (KeyError, TypeError, UnicodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a spooled record: {exc}") from exc


def _text(value: bytes) -> str:
    return value.decode("utf-8", "surrogateescape")


def _bytes(value: str) -> bytes:
    return value.encode("utf-8", "surrogateescape")


def _count_lines(path: Path) -> int:
    data = path.read_bytes()
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SpoolLockedError(RuntimeError):
    """Another live producer owns this spool directory."""


def _lock(directory: Path) -> IO[bytes]:
    lock = (directory / ".lock").open("ab")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise SpoolLockedError(
            f"spool {directory} is in use by another producer: give each process its own "
            "telemetry spool_dir"
        ) from None
    return lock


class Spool:
    """Owns its directory (an flock, released by close() or process exit). Not thread-safe:
    one owner (the producer thread) appends, reads and removes."""

    def __init__(
        self, directory: Path, max_bytes: int, segment_max_bytes: int = SEGMENT_MAX_BYTES
    ) -> None:
        if max_bytes < 1:
            raise ValueError(f"spool max_bytes must be positive, got {max_bytes}")
        self.directory = directory
        self.max_bytes = max_bytes
        # At least eight segments, so a full spool loses at most an eighth of itself at once.
        self.segment_max_bytes = max(1, min(segment_max_bytes, max_bytes // 8))
        directory.mkdir(parents=True, exist_ok=True)
        self._lock = _lock(directory)
        self._segments = deque(self._load())
        self._next_seq = self._segments[-1].seq + 1 if self._segments else 1
        self._active: Segment | None = None
        self._file: IO[bytes] | None = None

    def _load(self) -> list[Segment]:
        segments = []
        for path in self.directory.iterdir():
            match = _SEGMENT_RE.match(path.name)
            if match:
                seq = int(match.group(1))
                segments.append(Segment(seq, path, path.stat().st_size, _count_lines(path)))
        return sorted(segments, key=lambda segment: segment.seq)

    @property
    def num_bytes(self) -> int:
        return sum(segment.num_bytes for segment in self._segments)

    @property
    def num_records(self) -> int:
        """Records not yet acknowledged."""
        return sum(segment.num_records - segment.num_acked for segment in self._segments)

    @property
    def is_empty(self) -> bool:
        return not self._segments

    def append(self, records: Sequence[OutgoingRecord]) -> int:
        """Write and fsync; returns how many records were dropped to stay under max_bytes."""
        num_dropped = 0
        for record in records:
            line = encode(record)
            num_dropped += self._make_room(len(line))
            if len(line) > self.max_bytes:
                log.warning("telemetry record of %d bytes exceeds the spool; dropped", len(line))
                num_dropped += 1
                continue
            self._write(line)
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
        return num_dropped

    def _make_room(self, num_bytes: int) -> int:
        num_dropped = 0
        while self._segments and self.num_bytes + num_bytes > self.max_bytes:
            num_dropped += self._drop_oldest()
        return num_dropped

    def _drop_oldest(self) -> int:
        segment = self._segments[0]
        lost = segment.num_records - segment.num_acked
        log.warning(
            "telemetry spool full (%d bytes max): dropped oldest segment %s with %d records",
            self.max_bytes,
            segment.path.name,
            lost,
        )
        self.remove(segment)
        return lost

    def _write(self, line: bytes) -> None:
        active, file = self._writer(len(line))
        file.write(line)
        active.num_bytes += len(line)
        active.num_records += 1

    def _writer(self, num_bytes: int) -> tuple[Segment, IO[bytes]]:
        active, file = self._active, self._file
        if active is None or file is None or self._is_full(active, num_bytes):
            active, file = self._open_segment()
        return active, file

    def _is_full(self, segment: Segment, num_bytes: int) -> bool:
        return segment.num_records > 0 and segment.num_bytes + num_bytes > self.segment_max_bytes

    def _open_segment(self) -> tuple[Segment, IO[bytes]]:
        self._seal()
        path = self.directory / f"segment-{self._next_seq:012d}.jsonl"
        file = path.open("ab")
        _fsync_dir(self.directory)
        active = Segment(self._next_seq, path)
        self._segments.append(active)
        self._next_seq += 1
        self._active, self._file = active, file
        return active, file

    def _seal(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
        self._file = None
        self._active = None

    def oldest(self) -> Segment | None:
        """The oldest segment, sealed so that later appends go to a newer one."""
        if not self._segments:
            return None
        if self._segments[0] is self._active:
            self._seal()
        return self._segments[0]

    def read(self, segment: Segment) -> tuple[list[OutgoingRecord], int]:
        """The segment's records, and how many of its lines were unreadable (skipped)."""
        records = []
        lines = segment.path.read_bytes().split(b"\n")
        for number, line in enumerate(lines, start=1):
            if not line:
                continue
            try:
                records.append(decode(line))
            except ValueError as exc:
                log.warning("skipping %s line %d: %s", segment.path.name, number, exc)
        num_bad = segment.num_records - len(records)
        segment.num_records = len(records)
        return records, max(num_bad, 0)

    def remove(self, segment: Segment) -> None:
        if segment is self._active:
            self._seal()
        self._segments.remove(segment)
        segment.path.unlink(missing_ok=True)

    def close(self) -> None:
        self._seal()
        self._lock.close()
