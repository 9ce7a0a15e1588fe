"""GroupSchedule: the staleness rule's capacity claimed at issue and given back exactly once by every end
but training, on a real Redis shared by several rollout workers and the RL loop."""

from __future__ import annotations

import uuid

import pytest

from rlplatform.scheduling.groups import GroupSchedule
from rlplatform.scheduling.staleness import StalenessRule
from rlplatform.transport.redis_server import connect
from rlplatform.transport.reward_queue import RewardQueue
from rlplatform.transport.samples import Sample


@pytest.fixture
def job():
    return f"schedule-{uuid.uuid4().hex[:8]}"


def schedule(client, job, max_staleness=1, batch_prompts=4, policy="policy"):
    return GroupSchedule(client, job, policy, StalenessRule(max_staleness, batch_prompts))


def test_the_rule_by_hand():
    # (version + max_staleness + 1) * batch_prompts
    assert StalenessRule(0, 16).groups_allowed(0) == 16  # (0 + 0 + 1) * 16
    assert StalenessRule(1, 16).groups_allowed(0) == 32  # (0 + 1 + 1) * 16
    assert StalenessRule(1, 4).groups_allowed(5) == 28  # (5 + 1 + 1) * 4
    assert StalenessRule(2, 10).groups_allowed(3) == 60  # (3 + 2 + 1) * 10
    assert StalenessRule(2, 10).oldest_trainable(3) == 1 and StalenessRule(2, 10).groups_used(3) == 30


def test_issue_grants_up_to_the_bound_then_nothing(redis_client, job):
    groups = schedule(redis_client, job)
    # version 0: (0 + 1 + 1) * 4 = 8 groups may be in play
    assert len(groups.issue(0, 5, version=0)) == 5
    assert len(groups.issue(0, 5, version=0)) == 3
    assert groups.issue(0, 1, version=0) == []
    # version 2: (2 + 1 + 1) * 4 = 16 in all, 8 more; a worker still on version 0 gets none of them
    assert groups.issue(1, 1, version=0) == []
    assert len(groups.issue(0, 100, version=2)) == 8
    assert groups.ledger.counts()["issued"] == 16 and groups.issue(0, 0, version=9) == []


def test_capacity_is_shared_between_workers_and_kept_per_job(redis_server, redis_client, job):
    a, b = schedule(connect(redis_server), job, batch_prompts=3), schedule(connect(redis_server), job, batch_prompts=3)
    # bound (0 + 1 + 1) * 3 = 6 for the policy, not per worker
    assert len(a.issue(0, 4, version=0)) == 4
    assert len(b.issue(1, 4, version=0)) == 2
    assert a.issue(0, 1, version=0) == [] and b.issue(1, 1, version=0) == []
    assert len(schedule(redis_client, job + "-other", batch_prompts=3).issue(0, 6, version=0)) == 6


def test_every_end_but_training_gives_capacity_back_once(redis_client, job):
    groups = schedule(redis_client, job)
    issued = [group_id for group_id, _ in groups.issue(0, 8, version=0)]
    assert groups.issue(0, 1, version=0) == []
    assert groups.trained([issued[0]]) == [0]  # trained: its capacity stays used
    assert groups.issue(0, 1, version=0) == []
    assert groups.dropped(issued[1], "dropped_stale") and groups.expired(issued[2])
    assert not groups.dropped(issued[1], "dropped_error")  # already ended: counts once, frees nothing more
    assert not groups.dropped("agent-bridge-g1", "dropped_error")  # never issued or admitted: holds no capacity
    assert len(groups.issue(0, 10, version=0)) == 2
    counts = groups.ledger.counts()
    assert (counts["trained"], counts["dropped_stale"], counts["expired"], counts["dropped_error"]) == (1, 1, 1, 0)


def test_an_agents_group_claims_capacity_once_at_admission_and_is_never_issued_again(redis_client, job):
    from rlplatform.scheduling.ledger import balanced

    groups, other_worker = schedule(redis_client, job), schedule(redis_client, job)
    issued = [group_id for group_id, _ in groups.issue(0, 6, version=0)]  # 6 of (0 + 1 + 1) * 4
    assert groups.admit("task-7", version=0) and other_worker.admit("task-7", version=0)  # once, by either worker
    assert groups.admit("task-8", version=0)
    assert not groups.admit("task-9", version=0) and groups.issue(0, 1, version=0) == []  # the bound holds for agents
    assert groups.expired("task-7")  # its capacity back, and no prompt to issue again
    assert [position for _, position in groups.issue(0, 1, version=0)] == [6]
    assert groups.trained(["task-8"]) == [None] and groups.ledger.counts()["trained"] == 1  # no data position
    state = groups.ledger.state()
    assert sorted(state["in_flight_prompts"]) == list(range(7))  # the data's prompts only
    counts = groups.ledger.counts()
    assert counts["admitted"] == 2 and counts["issued"] == 9 and balanced(counts)
    assert issued and groups.ledger.position("task-7") is None


def test_a_restarted_worker_takes_over_its_predecessors_groups(redis_client, job):
    groups = schedule(redis_client, job)
    mine = [group_id for group_id, _ in groups.issue(0, 3, version=0)]
    groups.issue(1, 5, version=0)
    groups.submitted(mine[:1])  # in the reward queue: no longer the worker's to lose
    assert groups.taken_over(0) == 2
    assert groups.taken_over(0) == 0
    positions = [position for _, position in groups.issue(0, 2, version=0)]
    assert sorted(positions) == [1, 2]  # the abandoned groups' prompts come first
    assert groups.ledger.counts()["abandoned"] == 2


def test_resume_restores_the_allowance_the_learner_used(redis_client, job):
    first = schedule(redis_client, job, max_staleness=0, batch_prompts=4)
    first.trained([group_id for group_id, _ in first.issue(0, 4, version=0)])
    state = first.ledger.state()
    resumed = schedule(redis_client, job, max_staleness=0, batch_prompts=4)
    resumed.resume(state, attempt=1, learner_version=1)  # one step trained: (1 + 0 + 1) * 4 - 4 = 4 more
    assert len(resumed.issue(0, 10, version=1)) == 4
    assert resumed.issue(0, 1, version=1) == []


def test_synchronous_mode_one_batch_per_version(redis_client, job):
    groups = schedule(redis_client, job, max_staleness=0, batch_prompts=4)
    for version in range(4):
        assert len(groups.issue(0, 3, version=version)) == 3
        assert len(groups.issue(0, 3, version=version)) == 1
        assert groups.issue(0, 3, version=version) == []


def test_a_worker_that_dies_right_after_its_submit_has_nothing_to_abandon(redis_server, redis_client, job):
    """The groups a submit appends are released from their worker in the same step: a worker taken over just after
    it (its process or node gone) leaves them to be trained, not abandoned and issued again as well."""
    groups = schedule(redis_client, job)
    issued = [group_id for group_id, _ in groups.issue(3, 3, version=0)]
    queue = RewardQueue(connect(redis_server), job, max_pending=100)
    queue.create_group()
    samples = [Sample(f"{group_id}/{k}", group_id, "policy", "1+1=", "2", prompt_ids=[1], completion_ids=[2],
                      behaviour_logprobs=[-0.5], token_versions=[0]) for group_id in issued[:2] for k in range(2)]
    queue.submit(samples, claims=groups.submission(issued[:2]))
    assert queue.pending() == 4
    assert groups.taken_over(3) == 1  # only the group it had not submitted
    assert groups.trained(issued[:2]) == [0, 1] and groups.ledger.counts()["trained"] == 2
