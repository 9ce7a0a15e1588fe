"""Staleness control: the groups_allowed bound, and RolloutGate claims and releases on a real
Redis shared by several workers."""

from __future__ import annotations

import uuid

import pytest

from rlplatform.transport.redis_server import connect
from rlplatform.transport.staleness import RolloutGate, groups_allowed


@pytest.fixture
def job():
    return f"gate-{uuid.uuid4().hex[:8]}"


def test_groups_allowed_by_hand():
    # (version + max_staleness + 1) * batch_prompts
    assert groups_allowed(0, 0, 16) == 16  # (0 + 0 + 1) * 16
    assert groups_allowed(0, 1, 16) == 32  # (0 + 1 + 1) * 16
    assert groups_allowed(5, 1, 4) == 28  # (5 + 1 + 1) * 4
    assert groups_allowed(3, 2, 10) == 60  # (3 + 2 + 1) * 10
    assert groups_allowed(10, 0, 1) == 11  # (10 + 0 + 1) * 1


def test_claims_granted_up_to_the_bound_then_zero(redis_client, job):
    gate = RolloutGate(redis_client, job, max_staleness=1, batch_prompts=4)
    # version 0: (0 + 1 + 1) * 4 = 8 groups may be in play
    assert gate.claim(5, version=0) == 5
    assert gate.claim(5, version=0) == 3  # 8 - 5 left
    assert gate.claim(5, version=0) == 0
    assert gate.claim(1, version=0) == 0
    assert int(redis_client.get(gate.keys.groups_started)) == 8
    # version 2: (2 + 1 + 1) * 4 = 16 in all, 8 more
    assert gate.claim(100, version=2) == 8
    assert gate.claim(1, version=2) == 0
    # a worker still on old weights gets nothing while the others are ahead
    assert gate.claim(1, version=0) == 0


def test_claims_are_shared_between_workers(redis_server, redis_client, job):
    a = RolloutGate(connect(redis_server), job, max_staleness=1, batch_prompts=3)
    b = RolloutGate(connect(redis_server), job, max_staleness=1, batch_prompts=3)
    # bound (0 + 1 + 1) * 3 = 6 for the job, not per worker
    assert a.claim(4, version=0) == 4
    assert b.claim(4, version=0) == 2
    assert a.claim(1, version=0) == 0 and b.claim(1, version=0) == 0
    other_job = RolloutGate(redis_client, job + "-other", max_staleness=1, batch_prompts=3)
    assert other_job.claim(6, version=0) == 6  # another job has its own counter


def test_release_gives_capacity_back(redis_client, job):
    gate = RolloutGate(redis_client, job, max_staleness=1, batch_prompts=4)
    assert gate.claim(8, version=0) == 8
    assert gate.claim(1, version=0) == 0
    gate.release(3)  # three groups dropped: 5 in play of 8
    assert int(redis_client.get(gate.keys.groups_dropped)) == 3
    assert gate.claim(10, version=0) == 3
    assert gate.claim(1, version=0) == 0
    gate.release(0)  # no-op
    assert int(redis_client.get(gate.keys.groups_dropped)) == 3
    assert gate.claim(1, version=0) == 0


def test_synchronous_mode_one_batch_per_version(redis_client, job):
    batch_prompts = 4
    gate = RolloutGate(redis_client, job, max_staleness=0, batch_prompts=batch_prompts)
    for version in range(4):
        # bound (v + 0 + 1) * 4: exactly one more batch each time the version advances
        assert gate.claim(3, version=version) == 3
        assert gate.claim(3, version=version) == 1
        assert gate.claim(3, version=version) == 0
    assert int(redis_client.get(gate.keys.groups_started)) == 4 * batch_prompts


def test_zero_wanted_claims_nothing(redis_client, job):
    gate = RolloutGate(redis_client, job, max_staleness=1, batch_prompts=4)
    assert gate.claim(0, version=0) == 0
    assert redis_client.get(gate.keys.groups_started) is None
