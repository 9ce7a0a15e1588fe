"""A group's life from issue to its end, and the staleness capacity it holds meanwhile.

A policy's rollout workers and its RL loop each hold a `GroupSchedule` over the same Redis state:
the prompt ledger (which prompt each group answers, who holds it, how it ended) and the claim
counter of the staleness rule (groups started, groups ended untrained). Its methods are the life's
events: `issue` (capacity claimed, prompts taken) or `admit` (an agent's group through the OpenAI
bridge, capacity claimed at its first finished episode), `submitted`, then one end: `trained`,
`dropped` (with the reason), `expired` (prompt issued again), `taken_over` (a restarted worker's
predecessor's groups, prompts issued again); `resume` continues from a checkpoint. Every end but
`trained` gives the group's capacity back, once, and only if the ledger holds it open. This module is
the only one that claims or gives back capacity. An agent's group is played once: admitting one that
ended raises `GroupEnded`.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import redis

from rlplatform.scheduling.ledger import AGENT, PromptLedger
from rlplatform.scheduling.staleness import StalenessRule
from rlplatform.transport.keys import PolicyKeys
from rlplatform.transport.stream_queue import Claims

# KEYS: groups started, groups ended untrained. ARGV: groups wanted, groups allowed in play.
_CLAIM = """
local in_play = tonumber(redis.call('GET', KEYS[1]) or '0') - tonumber(redis.call('GET', KEYS[2]) or '0')
local grant = math.min(tonumber(ARGV[1]), tonumber(ARGV[2]) - in_play)
if grant <= 0 then return 0 end
redis.call('INCRBY', KEYS[1], grant)
return grant
"""


class GroupEnded(ValueError):
    """An agent finished an episode into a group that has ended."""


class GroupSchedule:
    """One policy's groups: the ledger and the staleness capacity, changed only through these events."""

    def __init__(self, client: redis.Redis, run: str, policy: str, rule: StalenessRule) -> None:
        self.client, self.rule = client, rule
        self.ledger = PromptLedger(client, run, policy)
        keys = PolicyKeys(run, policy)
        self._started, self._ended = keys.groups_started, keys.groups_dropped
        self._claim = client.register_script(_CLAIM)

    def issue(self, worker: int, wanted: int, version: int) -> List[Tuple[str, int]]:
        """(group id, prompt position) for as many of `wanted` new groups as rollout worker `worker`, holding
        weights of `version`, may start now."""
        granted = int(self._claim(keys=[self._started, self._ended], args=[wanted, self.rule.groups_allowed(version)]))
        return self.ledger.issue(worker, granted)

    def admit(self, group_id: str, version: int) -> Optional[int]:
        """An agent's group enters the schedule (its first finished episode), claiming capacity as an issued
        group does, by a worker holding weights of `version`. Once it is open (now or before): its prompt
        position (`AGENT` for an agent's own group; a taskset's groups are issued with one); None while the
        staleness rule allows no more groups in play (the agent tries again later)."""
        position = self.ledger.position(group_id)
        if position is not None:
            return position
        if self.ledger.has_ended(group_id):
            raise GroupEnded(f"group {group_id} has ended (trained, dropped, or expired unfinished)")
        if not int(self._claim(keys=[self._started, self._ended], args=[1, self.rule.groups_allowed(version)])):
            return None
        opened = self.ledger.admit(group_id)
        if not opened:  # another worker admitted it, or it ended, meanwhile: no claim of its own
            self._give_back(1)
        if opened is None:
            raise GroupEnded(f"group {group_id} has ended (trained, dropped, or expired unfinished)")
        return AGENT

    def submitted(self, group_ids: List[str]) -> None:
        """These groups are in the reward queue: a restart of their worker no longer abandons them."""
        self.ledger.submitted(group_ids)

    def submission(self, group_ids: List[str]) -> Claims:
        """`submitted` for these groups as a queue's submit does it, in the step that appends their samples
        (`StreamQueue.submit_payloads`): a worker that dies right after submitting has nothing left to abandon."""
        return self.ledger.claimed, list(group_ids)

    def trained(self, group_ids: List[str]) -> List[Optional[int]]:
        """The learner trained on these groups (their capacity stays used); each one's prompt position, or None
        for an agent's group or one the ledger did not hold open."""
        return [None if position == AGENT else position for position in self.ledger.close_all(group_ids, "trained")]

    def dropped(self, group_id: str, reason: str) -> bool:
        """The group will never be trained (`reason`: a ledger outcome such as dropped_stale); True if it
        was open here, its capacity given back."""
        return self._end(group_id, reason)

    def expired(self, group_id: str) -> bool:
        """The group did not complete in time: its prompt is issued again; True if it was open here."""
        return self._end(group_id, "expired", reissue=True)

    def taken_over(self, worker: int) -> int:
        """A restarted rollout worker takes its slot back: the groups its predecessor had not submitted
        end as abandoned, their prompts issued again; returns how many."""
        abandoned = self.ledger.abandon_worker(worker)
        self._give_back(abandoned)
        return abandoned

    def resume(self, ledger_state: Dict, attempt: int, learner_version: int) -> None:
        """Continue from a checkpoint: the ledger's state (prompts in flight then issued again first) and
        the capacity the learner's steps have used."""
        self.ledger.restore(ledger_state, attempt)
        pipe = self.client.pipeline(transaction=True)
        pipe.set(self._started, self.rule.groups_used(learner_version))
        pipe.set(self._ended, 0)
        pipe.execute()

    def _end(self, group_id: str, outcome: str, reissue: bool = False) -> bool:
        closed = self.ledger.close(group_id, outcome, reissue=reissue) is not None
        self._give_back(int(closed))
        return closed

    def _give_back(self, groups: int) -> None:
        if groups:
            self.client.incrby(self._ended, groups)
