"""GroupBuffer: assembling scored samples into complete groups, ignoring redeliveries, and
taking batches that drop stale and error groups and prefer the oldest policy version; partial groups
waiting past a timeout are listed for expiry."""

from __future__ import annotations

from typing import Optional

from rlplatform.scheduling.buffer import GroupBuffer, group_version
from rlplatform.scheduling.staleness import StalenessRule
from rlplatform.transport.samples import ResultMeta, Sample, ScoredSample


def scored(group: str, index: int, version: int = 0, reward: float = 1.0,
           error: Optional[str] = None) -> ResultMeta:
    sample = Sample(
        sample_id=f"{group}/{index}", group_id=group, policy="p", prompt="1+1=", completion="2",
        prompt_ids=[1, 2, 3], completion_ids=[4, 5], behaviour_logprobs=[-0.5, -0.5],
        token_versions=[version, version + 1],  # the oldest token sets the sample's version
    )
    return ResultMeta.of(ScoredSample(sample, reward, {"exact_match": reward}, error))


def fill(buffer: GroupBuffer, group: str, version: int = 0, errors: int = 0) -> None:
    for i in range(buffer.group_size):
        buffer.add(scored(group, i, version, reward=float(i % 2), error="boom" if i < errors else None))


def ids(groups) -> list:
    return [g[0].group_id for g in groups]


def test_groups_complete_only_at_group_size():
    buffer = GroupBuffer(group_size=3)
    buffer.add(scored("a", 0))
    buffer.add(scored("b", 0))
    buffer.add(scored("a", 1))
    assert not buffer.is_complete("a")
    buffer.add(scored("a", 2))
    assert buffer.is_complete("a") and not buffer.is_complete("b")
    buffer.add(scored("b", 1))
    assert not buffer.is_complete("b")
    buffer.add(scored("b", 2))
    assert buffer.is_complete("b")
    batch = buffer.take(0, StalenessRule(max_staleness=1, batch_prompts=2))
    assert ids(batch.groups) == ["a", "b"]
    assert [len(g) for g in batch.groups] == [3, 3]
    assert sorted(s.sample_id for s in batch.samples) == ["a/0", "a/1", "a/2", "b/0", "b/1", "b/2"]


def test_redelivered_duplicates_are_ignored():
    buffer = GroupBuffer(group_size=3)
    buffer.add(scored("a", 0))
    buffer.add(scored("a", 0))  # redelivered result
    buffer.add(scored("a", 1))
    buffer.add(scored("a", 1))
    assert not buffer.is_complete("a") and buffer.held_samples() == 2  # four adds, two distinct samples
    buffer.add(scored("a", 2))
    assert buffer.is_complete("a")
    (group,) = buffer.take(0, StalenessRule(max_staleness=0, batch_prompts=1)).groups
    assert [s.sample_id for s in group] == ["a/0", "a/1", "a/2"]


def test_redelivery_after_completion_does_not_train_a_group_twice():
    buffer = GroupBuffer(group_size=2)
    fill(buffer, "a")
    for i in range(2):  # the whole group is redelivered after it completed
        buffer.add(scored("a", i, reward=float(i % 2)))
    assert buffer.held_samples() == 2
    assert ids(buffer.take(0, StalenessRule(max_staleness=0, batch_prompts=1)).groups) == ["a"]
    assert buffer.held_samples() == 0
    fill(buffer, "a")  # and again after it was trained on
    assert buffer.held_samples() == 0 and buffer.take(0, StalenessRule(max_staleness=0, batch_prompts=1)).groups == []


def test_stale_groups_are_dropped():
    buffer = GroupBuffer(group_size=2)
    fill(buffer, "v3", version=3)
    fill(buffer, "v4", version=4)
    fill(buffer, "v5", version=5)
    # learner at 5 with max_staleness 1 trains on versions >= 4
    batch = buffer.take(5, StalenessRule(max_staleness=1, batch_prompts=2))
    assert ids(batch.dropped_stale) == ["v3"]
    assert ids(batch.groups) == ["v4", "v5"]
    assert batch.dropped_errors == []
    assert buffer.held_samples() == 0


def test_group_version_is_the_oldest_token():
    buffer = GroupBuffer(group_size=2)
    buffer.add(scored("mixed", 0, version=5))
    buffer.add(scored("mixed", 1, version=3))  # tokens of versions 3 and 4
    batch = buffer.take(5, StalenessRule(max_staleness=1, batch_prompts=1))
    assert ids(batch.dropped_stale) == ["mixed"] and batch.groups == []
    assert group_version(batch.dropped_stale[0]) == 3


def test_groups_with_fewer_than_two_valid_samples_are_dropped():
    buffer = GroupBuffer(group_size=3)
    fill(buffer, "two-errors", errors=2)  # one error-free sample left: dropped
    fill(buffer, "one-error", errors=1)  # two left: kept, without the failed sample
    fill(buffer, "clean")
    batch = buffer.take(0, StalenessRule(max_staleness=0, batch_prompts=2))
    assert ids(batch.dropped_errors) == ["two-errors"]
    assert batch.dropped_stale == []
    assert sorted(ids(batch.groups)) == ["clean", "one-error"]
    one_error = next(g for g in batch.groups if g[0].group_id == "one-error")
    assert [s.sample_id for s in one_error] == ["one-error/1", "one-error/2"]
    assert all(s.error is None for s in batch.samples)
    assert len(batch.samples) == 5


def test_take_returns_oldest_first_and_keeps_the_rest():
    buffer = GroupBuffer(group_size=2)
    for name, version in [("v7a", 7), ("v5", 5), ("v6", 6), ("v7b", 7), ("v5b", 5)]:
        fill(buffer, name, version=version)
    assert buffer.held_samples() == 10
    batch = buffer.take(7, StalenessRule(max_staleness=2, batch_prompts=3))
    assert ids(batch.groups) == ["v5", "v5b", "v6"]  # oldest first, arrival order within a version
    assert buffer.held_samples() == 4
    rest = buffer.take(7, StalenessRule(max_staleness=2, batch_prompts=2))
    assert ids(rest.groups) == ["v7a", "v7b"]
    assert buffer.held_samples() == 0


def test_take_returns_nothing_until_enough_groups():
    buffer = GroupBuffer(group_size=2)
    fill(buffer, "a", version=1)
    fill(buffer, "stale", version=0)
    batch = buffer.take(2, StalenessRule(max_staleness=1, batch_prompts=2))
    assert batch.groups == []
    assert ids(batch.dropped_stale) == ["stale"]  # dropped even when no batch is returned
    assert buffer.held_samples() == 2  # "a" is kept for a later take
    fill(buffer, "b", version=2)
    assert ids(buffer.take(2, StalenessRule(max_staleness=1, batch_prompts=2)).groups) == ["a", "b"]


def test_zero_advantage_groups_are_filtered_and_counted_when_asked():
    buffer = GroupBuffer(group_size=2)
    for group, rewards in (("same", (1.0, 1.0)), ("mixed", (0.0, 1.0))):
        for i, reward in enumerate(rewards):
            buffer.add(scored(group, i, reward=reward))
    batch = buffer.take(0, StalenessRule(max_staleness=0, batch_prompts=1), filter_zero_advantage=True)
    assert [g[0].group_id for g in batch.groups] == ["mixed"]
    assert [g[0].group_id for g in batch.dropped_zero_advantage] == ["same"]


def test_an_expired_group_drops_what_arrived_and_what_arrives_later():
    buffer = GroupBuffer(group_size=3)
    buffer.add(scored("lost", 0))
    buffer.add(scored("lost", 1))
    buffer.expire("lost")
    assert buffer.samples_expired == 2
    assert buffer.completed == []
    buffer.add(scored("lost", 2))  # late: the group would complete now, but it expired
    buffer.add(scored("lost", 2))  # and a redelivery of it
    assert buffer.samples_expired == 3 and buffer.held_samples() == 0 and not buffer.is_complete("lost")
    assert buffer.completed == ["lost"]  # its late completion is reported, for the group deadline
    fill(buffer, "kept")
    assert buffer.held_samples() == 3 and buffer.is_complete("kept") and buffer.completed == ["lost", "kept"]


def test_a_group_scored_by_a_teacher_several_versions_behind_is_dropped_as_stale():
    """On-policy distillation holds the teacher version that scored a group to the same rule as the student's."""
    buffer = GroupBuffer(group_size=2)
    for group, teacher in (("t2", 2), ("t4", 4), ("t5", 5)):
        for i in range(2):
            meta = scored(group, i, version=5, reward=float(i))
            meta.teacher_version = teacher if i else 5  # the group's oldest teacher version counts
            buffer.add(meta)
    # the student and the teacher both at 5, max_staleness 1: teacher versions >= 4
    batch = buffer.take(5, StalenessRule(max_staleness=1, batch_prompts=2), teacher_version=5)
    assert ids(batch.dropped_stale) == ["t2"] and ids(batch.groups) == ["t4", "t5"]
