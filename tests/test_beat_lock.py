"""The beat lock that keeps one scheduler running: the file lock (embedded transport) and the
Redis lock, with a standby taking over when the holder releases or stops renewing."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from services.workers.beat import FileLock, RedisLock, wait_for_lock
from tests.polling import wait_until


def test_file_lock_admits_one_holder_at_a_time(tmp_path: Path) -> None:
    first, second = FileLock(tmp_path / "beat.lock"), FileLock(tmp_path / "beat.lock")
    assert first.acquire()
    assert not second.acquire()
    first.release()
    assert second.acquire()
    assert second.renew()
    second.release()


def test_redis_lock_admits_one_holder_and_a_standby_takes_over(
    redis_url: str, tmp_path: Path
) -> None:
    key = f"sparseguard:test:{tmp_path.name}:beat-lock"
    holder, standby = RedisLock(redis_url, 30, key), RedisLock(redis_url, 30, key)
    assert holder.acquire()
    assert not standby.acquire()
    assert holder.renew() and not standby.renew()
    took_over = threading.Event()
    stop = threading.Event()

    def take_over() -> None:
        if wait_for_lock(standby, 0.05, stop):
            took_over.set()

    waiter = threading.Thread(target=take_over, daemon=True)
    waiter.start()
    time.sleep(0.3)
    assert not took_over.is_set()
    holder.release()
    assert took_over.wait(5)
    assert not holder.renew(), "the old holder must notice it lost the lock"
    assert standby.holder() == holder.holder() == standby.token  # what the health check reads
    standby.release()
    assert standby.holder() is None
    stop.set()


def test_redis_lock_expires_when_its_holder_stops_renewing(redis_url: str, tmp_path: Path) -> None:
    key = f"sparseguard:test:{tmp_path.name}:beat-lock"
    crashed, standby = RedisLock(redis_url, 0.3, key), RedisLock(redis_url, 0.3, key)
    assert crashed.acquire()
    assert not standby.acquire()
    wait_until(standby.acquire, 5, 0.05)
    standby.release()
