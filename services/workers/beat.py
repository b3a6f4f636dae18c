"""Exactly one beat: a beat runs only while it holds a lock (a Redis key with a TTL it keeps
renewing, or a file lock on the embedded default); others wait as standbys and take over when
the holder goes away."""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import IO, Protocol

import redis

from services.config import Settings
from services.workers.app import is_redis, make_celery

log = logging.getLogger(__name__)


class BeatLock(Protocol):
    def acquire(self) -> bool: ...
    def renew(self) -> bool: ...
    def release(self) -> None: ...


class RedisLock:
    """SET NX with a TTL; renewed only while the value is still ours."""

    RENEW = (
        "if redis.call('get', KEYS[1]) == ARGV[1] then "
        "return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"
    )
    RELEASE = (
        "if redis.call('get', KEYS[1]) == ARGV[1] then "
        "return redis.call('del', KEYS[1]) else return 0 end"
    )

    def __init__(self, url: str, ttl_s: float, key: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.key = key
        self.ttl_ms = int(ttl_s * 1000)
        self.token = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"

    def acquire(self) -> bool:
        return bool(self.client.set(self.key, self.token, nx=True, px=self.ttl_ms))

    def renew(self) -> bool:
        return bool(self.client.eval(self.RENEW, 1, self.key, self.token, self.ttl_ms))

    def release(self) -> None:
        self.client.eval(self.RELEASE, 1, self.key, self.token)

    def holder(self) -> str | None:
        """The token of the beat holding the lock (docker-compose's beat health check)."""
        value = self.client.get(self.key)
        return value.decode() if isinstance(value, bytes) else None


class FileLock:
    """An exclusive flock: the kernel releases it when the holder dies."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None

    def acquire(self) -> bool:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle = self.path.open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            return False
        self._file = handle
        return True

    def renew(self) -> bool:
        return self._file is not None

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def beat_lock(settings: Settings) -> BeatLock:
    if is_redis(settings):
        key = f"sparseguard:{settings.jobs.queue}:beat-lock"
        return RedisLock(settings.celery_broker_url, settings.jobs.beat_lock_ttl_s, key)
    return FileLock(settings.home / "beat.lock")


def wait_for_lock(lock: BeatLock, retry_s: float, stop: threading.Event) -> bool:
    """Block until the lock is ours (True) or `stop` is set (False)."""
    waiting = False
    while not stop.is_set():
        if lock.acquire():
            return True
        if not waiting:
            log.info("another beat holds the lock; standing by")
            waiting = True
        stop.wait(retry_s)
    return False


def keep_lock(lock: BeatLock, interval_s: float, stop: threading.Event) -> None:
    """Renew until `stop`; a lost lock stops this beat (another may have taken over)."""
    while not stop.wait(interval_s):
        try:
            held = lock.renew()
        except redis.RedisError as exc:
            log.warning("could not renew the beat lock: %s", exc)
            continue
        if not held:
            log.error("lost the beat lock; stopping this beat")
            os.kill(os.getpid(), signal.SIGTERM)
            return


def run_beat(settings: Settings, loglevel: str = "INFO") -> None:
    lock = beat_lock(settings)
    stop = threading.Event()
    ttl = settings.jobs.beat_lock_ttl_s
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        if not wait_for_lock(lock, ttl / 3, stop):
            return
    finally:
        signal.signal(signal.SIGTERM, previous)
    log.info("beat lock acquired; schedules run in UTC")
    renewer = threading.Thread(target=keep_lock, args=(lock, ttl / 3, stop), daemon=True)
    renewer.start()
    try:
        app = make_celery(settings)
        schedule = settings.home / "celerybeat-schedule"
        schedule.parent.mkdir(parents=True, exist_ok=True)
        app.Beat(loglevel=loglevel, schedule=str(schedule), quiet=True).run()
    finally:
        stop.set()
        lock.release()
        log.info("beat stopped; lock released")
