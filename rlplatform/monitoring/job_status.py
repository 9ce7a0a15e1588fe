"""A job's live progress on Redis: written by the controller, read by `rlp status` anywhere.

The status hash `rlp:<job>:<run id>:status` holds the fields of the console's progress line (stage,
step, reward, accuracy, samples/s, queue depth, staleness, ETA), the workers gone silent (while
any are), the OpenAI bridges' URLs (while they serve) and when they were written.
"""

from __future__ import annotations

import time
from typing import Dict, List

import redis

from rlplatform.transport.bridge_protocol import BRIDGE_STATUS_PREFIX
from rlplatform.transport.deadlines import Beat
from rlplatform.transport.keys import JobKeys

STATUS_TTL_S = 7 * 24 * 3600  # a finished job's status stays readable for a week
SILENT_WORKERS = "silent_workers"


class JobStatus:
    def __init__(self, client: redis.Redis, run: str) -> None:
        self.client = client
        self.key = JobKeys(run).status

    def write(self, fields: Dict[str, object]) -> None:
        """A progress line: its fields replace the previous line's, so a stage's own figures (SFT's loss)
        do not outlive it; the fields `set` on their own stay."""
        values = {k: str(v) for k, v in fields.items()}
        values["updated_at"] = f"{time.time():.3f}"
        stale = [k for k in map(bytes.decode, self.client.hkeys(self.key)) if k not in values and
                 not _set_on_its_own(k)]
        pipe = self.client.pipeline(transaction=False)
        if stale:
            pipe.hdel(self.key, *stale)
        pipe.hset(self.key, mapping=values)
        pipe.expire(self.key, STATUS_TTL_S)
        pipe.execute()

    def set(self, field: str, value: str) -> None:
        """One field, removed when `value` is empty."""
        if value:
            self.client.hset(self.key, field, value)
        else:
            self.client.hdel(self.key, field)

    def read(self) -> Dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.client.hgetall(self.key).items()}


def _set_on_its_own(field: str) -> bool:
    """Fields not part of a progress line: the silent workers (`set`) and the bridges' URLs (`announce`)."""
    return field == SILENT_WORKERS or field.startswith(BRIDGE_STATUS_PREFIX)


def format_beats(beats: List[Beat], now: float) -> List[str]:
    """One line per worker on the job's heartbeat hash: where it runs, what it is doing, its last progress."""
    return [f"{beat.describe()}: last progress {now - beat.at:.0f}s ago (longest between two {beat.longest_round_s:g}s)"
            for beat in sorted(beats, key=lambda beat: beat.worker)]


def format_status(fields: Dict[str, str], now: float) -> str:
    """The one-line view `rlp status` prints."""
    age = now - float(fields.get("updated_at", now))
    shown = {k: v for k, v in fields.items() if k != "updated_at"}
    return "  ".join(f"{k} {v}" for k, v in shown.items()) + f"  (updated {age:.0f}s ago)"
