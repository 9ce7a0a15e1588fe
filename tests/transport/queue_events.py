"""What reward-queue tests wait for on a real Redis, in place of fixed sleeps: a producer at the
bound asking again and being refused, a held request idle long enough to be reclaimed. Each wait
polls the server until the event has happened, and fails after `timeout_s`."""

from __future__ import annotations

import threading
import time
from typing import Callable

import redis


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0, poll_s: float = 0.005) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g}s"
        time.sleep(poll_s)


def scripts_run(client: redis.Redis) -> int:
    """Scripts (EVALSHA) the server has run so far; a producer's submit runs one per attempt."""
    return int(client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


def wait_for_refusals(client: redis.Redis, producer: threading.Thread, since: int, attempts: int = 3) -> None:
    """Until `producer`, the only one running scripts since the server had run `since`, has tried
    `attempts` more times (each refused while the stream stays full), or has returned (it got in)."""
    wait_until(lambda: scripts_run(client) >= since + attempts or not producer.is_alive(),
               f"{attempts} submits refused at the bound")


def wait_until_idle(client: redis.Redis, stream: str, group: str, idle_ms: int) -> None:
    """Until a request of `group` on `stream` has been held unacknowledged for `idle_ms` by Redis's clock."""
    wait_until(lambda: client.xpending_range(stream, group, min="-", max="+", count=1, idle=idle_ms),
               f"a request held {idle_ms} ms")
