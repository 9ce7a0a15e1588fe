"""A run's keys as one whole, on a real redis-server: what a start (or resume) and an end of the run leave."""

from __future__ import annotations

import uuid

from rlplatform.transport.keys import JobKeys, PolicyKeys, run_scope
from rlplatform.transport.run_keys import end_run, start_run


def test_a_start_leaves_the_status_and_the_new_bound_and_an_end_the_status_and_the_stop_flag(redis_client):
    run, other = run_scope("keys", uuid.uuid4().hex[:8]), run_scope("keys", uuid.uuid4().hex[:8])
    keys, policy = JobKeys(run), PolicyKeys(run, "p")
    for scope in (run, other):  # an earlier attempt's queues, ledger, capacity and counters; another run's too
        redis_client.xadd(JobKeys(scope).requests, {"data": b"left"})
        redis_client.hset(PolicyKeys(scope, "p").rollout_stats, "samples", 3)
        redis_client.rpush(PolicyKeys(scope, "p").ledger.open, "g0")
        redis_client.incr(PolicyKeys(scope, "p").groups_started)
        redis_client.hset(JobKeys(scope).status, "stage", "rl")
    redis_client.set(keys.max_pending, 7)
    others = sorted(redis_client.scan_iter(match=JobKeys(other).pattern))
    start_run(redis_client, run, 64)
    assert sorted(redis_client.scan_iter(match=keys.pattern)) == sorted([keys.status.encode(), keys.max_pending.encode()])
    assert redis_client.get(keys.max_pending) == b"64" and redis_client.hget(keys.status, "stage") == b"rl"
    redis_client.set(keys.stop, 1)
    redis_client.hset(policy.rollout_stats, "samples", 1)
    end_run(redis_client, run)
    assert sorted(redis_client.scan_iter(match=keys.pattern)) == sorted([keys.status.encode(), keys.stop.encode()])
    assert sorted(redis_client.scan_iter(match=JobKeys(other).pattern)) == others  # never touched
