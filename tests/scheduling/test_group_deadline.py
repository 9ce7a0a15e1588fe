"""GroupDeadline: a fixed `rl.group_timeout_s`, or the hang rule on the longest a group took from its claim
to its last scored sample; an expired group completing late lengthens it, one that never completes does not."""

from __future__ import annotations

from rlplatform.monitoring.watchdog import HangRule
from rlplatform.scheduling.group_deadline import GroupDeadline

RULE = HangRule(factor=10, floor_s=5)


def test_a_set_timeout_is_kept_whatever_groups_take():
    deadline = GroupDeadline(30.0, RULE.deadline_s, RULE.floor_s)
    deadline.seen({"a": 100.0})
    deadline.completed(["a"], 200.0)
    assert deadline.deadline_s() == 30.0
    deadline.seen({"b": 100.0, "c": 171.0})
    assert deadline.overdue(200.0) == ["b"]


def test_unset_it_is_the_hang_rule_on_the_longest_group_so_far():
    deadline = GroupDeadline(None, RULE.deadline_s, RULE.floor_s)
    assert deadline.deadline_s() == 50.0  # nothing measured: the factor times the floor
    deadline.seen({"a": 100.0, "b": 100.0, "slow": 100.0})
    deadline.completed(["a"], 100.2)
    assert deadline.deadline_s() == 5.0  # 10 x 0.2 s is under the floor
    deadline.completed(["b"], 102.0)
    assert deadline.deadline_s() == 20.0
    deadline.seen({"slow": 100.0})  # the complete ones trained and closed in the ledger
    assert deadline.overdue(119.0) == [] and deadline.overdue(121.0) == ["slow"]
    deadline.completed(["never-seen"], 500.0)  # claimed and completed between two reads: nothing to measure
    assert deadline.deadline_s() == 20.0
    deadline.recovery_s = 15.0  # a hung worker the group waits on may take this long to find and restart
    assert deadline.deadline_s() == 35.0 and deadline.overdue(121.0) == []


def test_an_expired_group_that_completes_late_lengthens_the_deadline():
    deadline = GroupDeadline(None, RULE.deadline_s, RULE.floor_s)
    deadline.seen({"a": 0.0, "late": 10.0, "lost": 10.0})
    deadline.completed(["a"], 2.0)
    deadline.seen({"late": 10.0, "lost": 10.0})
    assert deadline.overdue(31.0) == ["late", "lost"]
    for group in ("late", "lost"):
        deadline.expired(group)
    deadline.seen({"next": 40.0})  # the expired groups closed in the ledger
    assert deadline.overdue(41.0) == []  # an expired group is not expired again
    deadline.completed(["late"], 70.0)  # its samples all came, 60 s after its claim: the job slowed down
    assert deadline.deadline_s() == 600.0 and deadline.overdue(100.0) == []
