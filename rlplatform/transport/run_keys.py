"""A run's keys on the job's Redis as one whole (`keys.JobKeys.pattern`): their life is decided here alone.

- `start_run`, before a run starts or resumes: nothing of an earlier attempt of the run is left but its status,
  and the job's producer bound is recorded for every producer. Queues, results, ledgers, capacity and counters
  go: each owner rebuilds its own from the run's checkpoint at a resume (the ledger and the staleness capacity in
  `GroupSchedule`, the counters in the RL loop), never from what an attempt left.
- `end_run`, after the run: its queues and counters go; its status and stop flag stay until they expire (a week,
  `job_status.STATUS_TTL_S`; an hour, `RewardQueue.request_stop`), so `rlp status` and standalone workers still
  read them.

The keys of other runs, of its name or another, are never touched.
"""

from __future__ import annotations

from typing import Set

import redis

from rlplatform.transport.keys import JobKeys
from rlplatform.transport.stream_queue import as_text


def start_run(client: redis.Redis, run: str, max_pending: int) -> None:
    """Clear what an earlier attempt of run `run` (its `run_scope`) left but its status, and record the job's
    bound on pending requests (`redis.max_stream_len`) that producers built without one read."""
    keys = JobKeys(run)
    _delete_all_but(client, keys, {keys.status, keys.max_pending})
    client.set(keys.max_pending, max_pending)


def end_run(client: redis.Redis, run: str) -> None:
    """After run `run`: everything but its status and stop flag goes."""
    keys = JobKeys(run)
    _delete_all_but(client, keys, {keys.status, keys.stop})


def _delete_all_but(client: redis.Redis, keys: JobKeys, keep: Set[str]) -> None:
    doomed = [key for key in client.scan_iter(match=keys.pattern, count=1000) if as_text(key) not in keep]
    if doomed:
        client.delete(*doomed)
