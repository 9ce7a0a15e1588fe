"""The mirrored ledger, against a real ledger on Redis that goes on after the mirror's read: groups issued after the
read (a fresh position, a re-issued one, one a dead worker let go) and trained before Redis went away are closed by
their prompt positions, so that a resume from the mirror trains no prompt twice and skips none."""

from __future__ import annotations

from rlplatform.scheduling.ledger import PromptLedger, balanced
from rlplatform.scheduling.ledger_mirror import LedgerMirror


def test_groups_issued_after_the_read_and_trained_are_closed_by_their_positions(redis_client):
    ledger = PromptLedger(redis_client, "run", "policy")
    (g1, p0), (g2, p1), (g3, p2) = ledger.issue(worker=0, groups=3)
    ledger.close(g1, "trained")
    ledger.close(g2, "dropped_stale", reissue=True)  # its prompt waits to be issued again
    mirror = LedgerMirror(*ledger.snapshot())  # read: g3 open at 2, 1 waiting, cursor 3

    (g4, q1), (g5, p3), (g6, p4) = ledger.issue(worker=1, groups=3)
    assert (q1, p3, p4) == (1, 3, 4)
    ledger.abandon_worker(0)  # g3's worker died: 2 is issued again
    [(g7, q2)] = ledger.issue(worker=1, groups=1)
    assert q2 == 2
    trained = [(g6, p4), (g7, q2), (g4, q1)]  # a learner step's, after which Redis went away; g5 was in flight
    assert mirror.close_trained(trained) == [4, 2, 1]
    assert mirror.close_trained([(g6, p4)]) == [None]  # closed once

    state = mirror.state()
    counts = mirror.counts()
    assert balanced(counts) and counts["trained"] == 4 and counts["open"] == 1, counts
    resumed = PromptLedger(redis_client, "run", "resumed")
    resumed.restore(state, attempt=1)
    issued = [position for _, position in resumed.issue(worker=0, groups=3)]
    assert issued == [3, 5, 6]  # the one in flight first, then fresh positions: 0, 1, 2 and 4 were trained
    assert balanced(resumed.counts())


def test_an_agents_group_admitted_after_the_read_is_counted_without_a_position(redis_client):
    ledger = PromptLedger(redis_client, "run", "policy")
    [(g1, p0)] = ledger.issue(worker=0, groups=1)
    mirror = LedgerMirror(*ledger.snapshot())
    assert mirror.close_trained([("agent-7", -1), (g1, p0)]) == [None, 0]
    assert mirror.close_trained([("agent-7", -1)]) == [None]  # closed once
    assert mirror.counts()["admitted"] == 1 and mirror.counts()["trained"] == 2
    assert mirror.state()["in_flight_prompts"] == [] and mirror.state()["cursor"] == 1
    assert balanced(mirror.counts())
