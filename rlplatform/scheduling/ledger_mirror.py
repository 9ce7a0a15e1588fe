"""The prompt ledger as the RL loop last read it from Redis, kept up to date by the groups the learner trains
since: what a checkpoint holds of the ledger when the job's Redis went away.

Rollout workers keep issuing groups after each read, so a learner step can train a group the read never saw.
Its sample carries its prompt position (`Sample.prompt_position`), and the mirror closes it by that: a position
the read held in flight is no longer re-issued (nor is the group that held it then kept open), and a position
past the read's cursor moves the cursor past it, the positions it skipped held in flight (issued after the read
and not known trained: a resume issues them again). A resume from the mirror then trains no prompt twice and
skips none. An agent's group has no position: one admitted after the read is only counted.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional, Set, Tuple

from rlplatform.scheduling.ledger import AGENT


class LedgerMirror:
    """`PromptLedger.snapshot()` as read, with the groups trained since closed in it."""

    def __init__(self, state: Dict, open_groups: Dict[str, int]) -> None:
        """`state`, `open_groups`: a `PromptLedger.snapshot()`, read for this mirror (it keeps them and changes them)."""
        self._state = state
        self._open = open_groups  # group id -> prompt position (AGENT: an agent's group)
        self._skipped: Set[int] = set()  # positions past the read's cursor, issued since and not known trained
        self._agents_closed: Set[str] = set()  # agents' groups admitted since the read and closed here

    def state(self) -> Dict:
        """The ledger's `state()` as a checkpoint keeps it."""
        return copy.deepcopy(self._state)

    def counts(self) -> Dict[str, int]:
        """The ledger's `counts()`: each count and `open`."""
        return {**self._state["counts"], "open": self._state["open"]}

    def close_trained(self, groups: List[Tuple[str, int]]) -> List[Optional[int]]:
        """Close (group id, prompt position) pairs a learner step trained, as the ledger would have; returns each
        group's prompt position, None for an agent's group or one closed already."""
        return [self._close(group_id, position) for group_id, position in groups]

    def _close(self, group_id: str, position: int) -> Optional[int]:
        in_flight = self._state["in_flight_prompts"]
        if group_id in self._open:  # open when read
            position = self._open.pop(group_id)
            self._count("trained", opened=-1)
            if position == AGENT:
                return None
            in_flight.remove(position)
            return position
        if position == AGENT:  # an agent's group admitted since the read
            if group_id not in self._agents_closed:
                self._agents_closed.add(group_id)
                self._count("issued")
                self._count("admitted")
                self._count("trained")
            return None
        if position in self._skipped:  # issued since the read, after a position past it was trained
            self._skipped.remove(position)
            in_flight.remove(position)
            self._count("trained", opened=-1)
            return position
        cursor = self._state["cursor"]
        if position >= cursor:  # a fresh position issued since the read: those before it were issued too
            skipped = list(range(cursor, position))
            self._skipped.update(skipped)
            in_flight.extend(skipped)
            self._count("issued", len(skipped), opened=len(skipped))
            self._state["cursor"] = position + 1
            self._count("issued")
            self._count("trained")
            return position
        if position in in_flight:  # re-issued since the read: the group that held it then let it go
            in_flight.remove(position)
            for held_by in [g for g, p in self._open.items() if p == position]:
                del self._open[held_by]
                self._count("abandoned", opened=-1)
            self._count("issued")
            self._count("reissued")
            self._count("trained")
            return position
        return None  # the ledger had closed it before the read

    def _count(self, outcome: str, by: int = 1, *, opened: int = 0) -> None:
        counts = self._state["counts"]
        counts[outcome] = counts.get(outcome, 0) + by
        self._state["open"] += opened
