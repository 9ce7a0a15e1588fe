"""The prompt ledger on a real Redis: prompts issued in shuffled passes, each group ending once,
a dead worker's unsubmitted groups re-issued, open groups' claim times read, and a checkpoint's state
restored with what was in flight issued again first."""

from __future__ import annotations


from rlplatform.scheduling.ledger import PromptLedger, balanced, prompt_row


def test_each_pass_over_the_rows_is_a_fresh_shuffle_of_all_of_them():
    first = [prompt_row(p, 10, seed=3) for p in range(10)]
    second = [prompt_row(p, 10, seed=3) for p in range(10, 20)]
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    assert first == [prompt_row(p, 10, seed=3) for p in range(10)]


def test_groups_end_once_and_the_counts_balance(redis_client):
    ledger = PromptLedger(redis_client, "job", "p")
    issued = ledger.issue(worker=0, groups=3)
    assert [position for _, position in issued] == [0, 1, 2]
    assert len({group for group, _ in issued}) == 3
    assert ledger.close(issued[0][0], "trained") == 0 and ledger.close(issued[0][0], "expired") is None
    assert ledger.close(issued[1][0], "dropped_stale") == 1  # each close gives the group's prompt position
    counts = ledger.counts()
    assert counts["issued"] == 3 and counts["trained"] == 1 and counts["dropped_stale"] == 1
    assert counts["expired"] == 0 and counts["open"] == 1 and balanced(counts)
    # open: issued and not ended; a group it never issued (an agent's) is not
    assert [ledger.position(g) is not None for g, _ in issued] == [False, False, True] and \
        ledger.position("agent-7") is None


def test_closing_a_batch_of_groups_ends_each_once_in_one_call(redis_client):
    ledger = PromptLedger(redis_client, "job-batch", "p")
    groups = [group for group, _ in ledger.issue(worker=0, groups=4)]
    assert ledger.close_all(groups[:3], "trained") == [0, 1, 2]
    assert ledger.close_all([groups[1], groups[3], "agent-7"], "trained") == [None, 3, None]  # each ends once
    counts = ledger.counts()
    assert counts["trained"] == 4 and counts["open"] == 0 and balanced(counts)


def test_a_restarted_worker_abandons_only_its_unsubmitted_groups_and_they_are_issued_again(redis_client):
    ledger = PromptLedger(redis_client, "job", "p")
    mine = ledger.issue(worker=1, groups=3)
    other = ledger.issue(worker=2, groups=1)
    ledger.submitted([mine[0][0]])  # in the reward queue: not abandoned
    assert ledger.abandon_worker(1) == 2
    again = ledger.issue(worker=1, groups=3)
    assert [p for _, p in again] == [mine[1][1], mine[2][1], other[0][1] + 1]
    counts = ledger.counts()
    assert counts["abandoned"] == 2 and counts["reissued"] == 2 and counts["open"] == 5 and balanced(counts)


def test_open_groups_are_read_with_their_claim_times(redis_client):
    now = [1000.0]
    ledger = PromptLedger(redis_client, "job", "p", clock=lambda: now[0])
    (old, _), = ledger.issue(worker=0, groups=1)
    now[0] += 0.3
    (new, _), = ledger.issue(worker=0, groups=1)
    ledger.admit("agent-task")
    assert ledger.open_since() == {old: 1000.0, new: 1000.3, "agent-task": 1000.3}
    ledger.close(old, "trained")
    assert set(ledger.open_since()) == {new, "agent-task"}
    assert ledger.admit("agent-task") is False  # open already
    ledger.close("agent-task", "expired")
    assert ledger.has_ended("agent-task") and not ledger.has_ended(new)
    assert ledger.admit("agent-task") is None  # an agent's group is played once


def test_an_expired_group_s_prompt_is_issued_again(redis_client):
    ledger = PromptLedger(redis_client, "job", "p")
    (late, position), = ledger.issue(worker=0, groups=1)
    assert ledger.close(late, "expired", reissue=True) == position
    (again, same), = ledger.issue(worker=1, groups=1)
    assert same == position and again != late
    counts = ledger.counts()
    assert counts["expired"] == 1 and counts["reissued"] == 1 and counts["open"] == 1 and balanced(counts)


def test_restored_state_issues_what_was_in_flight_first_under_new_group_ids(redis_client):
    ledger = PromptLedger(redis_client, "job", "p")
    before = ledger.issue(worker=0, groups=4)
    ledger.close(before[0][0], "trained")
    state = ledger.state()
    redis_client.flushdb()  # a fresh Redis for the resumed job
    resumed = PromptLedger(redis_client, "job", "p")
    resumed.restore(state, attempt=1)
    after = resumed.issue(worker=0, groups=4)
    assert [p for _, p in after] == [1, 2, 3, 4]  # the three in flight, then the next position
    assert not {g for g, _ in after} & {g for g, _ in before}
    counts = resumed.counts()
    assert counts["trained"] == 1 and counts["abandoned"] == 3 and counts["issued"] == 8 and balanced(counts)
