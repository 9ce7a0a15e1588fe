"""Sample accounting at the end of an RL stage, on a real Redis: every untrained sample is counted
where it sits (the group buffer, the results stream, the request stream, the dead letters) and
attributed to its own policy, and samples cut from a trained group are counted as dropped; dropped
groups give back the staleness capacity they claimed, agents' groups admitted through the OpenAI bridge included."""

from __future__ import annotations

import time
from types import SimpleNamespace

from rlplatform.job.rl_loop import RLCounters, _drop, _unused_at_end
from rlplatform.scheduling.buffer import GroupBuffer
from rlplatform.scheduling.groups import GroupSchedule
from rlplatform.scheduling.staleness import StalenessRule
from rlplatform.transport.reward_queue import RewardQueue
from rlplatform.transport.run_keys import start_run
from rlplatform.transport.samples import ResultMeta, Sample, ScoredSample


def sample(policy: str, group: str, i: int) -> Sample:
    return Sample(f"{group}/{i}", group, policy, "1+1=", "2", prompt_ids=[4], completion_ids=[5, 2],
                  behaviour_logprobs=[-0.1, -0.2], token_versions=[0, 0], row={"answer": "2"})


def scored(policy: str, group: str, i: int, reward: float = 1.0, error=None) -> ScoredSample:
    return ScoredSample(sample(policy, group, i), reward, {"exact_match": reward}, error=error)


def test_unused_samples_are_counted_where_they_sit_per_policy(redis_client):
    queue = RewardQueue(redis_client, "accounting")
    start_run(queue.client, queue.keys.run, queue.bound())
    queue.create_group()
    queue.submit([sample("a", "qa", i) for i in range(5)] + [sample("b", "qb", i) for i in range(2)])
    held = queue.fetch("reward-0", count=3, block_ms=10)  # a reward worker holds 3 requests of policy a
    queue.store_results([(held[0][0], scored("a", "qa", 0))])  # one scored, its result not read yet
    queue.dead_letter(held[1][0], held[1][1], "undecodable")  # one dead-lettered; held[2] stays pending
    buffer = GroupBuffer(group_size=4)
    for i in range(4):
        buffer.add(ResultMeta.of(scored("a", "ga", i)))  # a complete group, not taken
    buffer.add(ResultMeta.of(scored("a", "gb", 0)))  # a group still filling
    runs = {"a": SimpleNamespace(buffer=buffer), "b": SimpleNamespace(buffer=GroupBuffer(group_size=4))}
    assert _unused_at_end(runs, queue) == {
        "a": {"in_buffer": 5, "scored_unread": 1, "unscored": 4},  # 2 unread + 1 held + 1 dead letter
        "b": {"in_buffer": 0, "scored_unread": 0, "unscored": 2}}


def test_samples_cut_from_a_trained_group_are_counted_as_dropped(redis_client):
    buffer = GroupBuffer(group_size=4)
    for i in range(4):
        buffer.add(ResultMeta.of(scored("a", "g", i, reward=float(i % 2), error="timeout" if i == 3 else None)))
    batch = buffer.take(0, StalenessRule(max_staleness=1, batch_prompts=1))
    counters = RLCounters()
    schedule = GroupSchedule(redis_client, f"accounting-{time.time_ns()}", "a", StalenessRule(1, 1))
    _drop(batch, counters, schedule)
    assert len(batch.samples) == 3 and counters.samples_dropped_invalid == 1
    assert schedule.ledger.counts()["dropped_error"] == 0  # the group is trained, not ended as dropped


def test_dropped_groups_give_back_the_capacity_they_claimed(redis_client):
    rule = StalenessRule(max_staleness=1, batch_prompts=2)
    schedule = GroupSchedule(redis_client, f"accounting-{time.time_ns()}", "a", rule)
    issued = [group_id for group_id, _ in schedule.issue(worker=0, wanted=3, version=0)]  # 3 of (0 + 1 + 1) * 2
    assert schedule.admit("task-7", version=0)  # an agent's group, via the bridge: the fourth
    assert not schedule.admit("task-8", version=0) and schedule.issue(worker=0, wanted=1, version=0) == []
    buffer = GroupBuffer(group_size=2)
    for group in (issued[0], "task-7"):
        for i in range(2):
            buffer.add(ResultMeta.of(scored("a", group, i, reward=float(i))))
    batch = buffer.take(3, rule)  # version 0 at learner version 3: both too stale
    counters = RLCounters()
    assert len(batch.dropped_stale) == 2
    _drop(batch, counters, schedule)
    assert counters.samples_dropped_stale == 4
    assert schedule.ledger.counts()["dropped_stale"] == 2 and schedule.ledger.counts()["open"] == 2
    assert len(schedule.issue(worker=0, wanted=4, version=0)) == 2  # both groups' capacity came back


def test_counters_with_reward_reasons_round_trip_through_a_checkpoint(tmp_path):
    from collections import Counter

    from rlplatform.job.checkpoint import CheckpointState, PolicyState, read_state, write_checkpoint

    counters = RLCounters(samples_trained=24, reward_errors=3)
    counters.reward_reasons.update(["code_tests/failed"] * 17 + ["code_tests/error"] * 3)  # as a code-task job counts
    counters.staleness_trained.update({0: 16, 1: 8})
    policy = PolicyState(version=3, counters=counters.state(), ledger={}, eval_history=[], rewards={})
    state = CheckpointState(results={}, wandb_run_id=None, attempt=0, policies={"policy": policy})
    path = write_checkpoint(str(tmp_path), 3, state, lambda directory: None, keep_last=2)
    assert read_state(path) == state
    restored = RLCounters.from_state(read_state(path).policies["policy"].counters)
    assert restored == counters
    assert restored.reward_reasons == Counter({"code_tests/failed": 17, "code_tests/error": 3})
