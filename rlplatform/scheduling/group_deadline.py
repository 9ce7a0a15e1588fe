"""How long a group may stay incomplete after its claim before the RL loop expires it.

A group is claimed when the ledger issues it to a rollout worker (or admits an agent's group at its
first finished episode) and completes when its last sample is scored. `rl.group_timeout_s` fixes the
deadline; unset, it is derived like the watchdog's: `monitoring.hang_factor` times the longest a group
took so far, at least `monitoring.hang_floor_s` (before any group was measured, the factor times the
floor), plus `recovery_s`, the longest the job may take to find a hung worker the group waits on and
restart it (the RL loop sets it from the watchdog's deadlines): a group waits out a recovery instead of
expiring during one. Claim times come from the ledger's reads (`seen`); completions from the buffer
(`completed`).
An expired group whose samples all arrive later is measured too, so a job that slowed down lengthens
its deadline instead of expiring every group from then on; a group that never completes (a lost
sample, a stopped agent) leaves it as it was.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional


class GroupDeadline:
    def __init__(self, fixed_s: Optional[float], rule: Callable[[float], float], floor_s: float) -> None:
        self.fixed_s = fixed_s
        self._rule, self._floor_s = rule, floor_s
        self.longest_s = 0.0  # the longest a group took from its claim to its last scored sample
        self.recovery_s = 0.0  # the longest recovering a hung worker may take now
        self._claimed: Dict[str, float] = {}  # open groups' claim times, as the ledger last read them
        self._expired: Dict[str, float] = {}  # expired groups' claim times, until they complete late

    def deadline_s(self) -> float:
        if self.fixed_s is not None:
            return self.fixed_s
        return self._rule(self.longest_s or self._floor_s) + self.recovery_s

    def seen(self, claimed_at: Dict[str, float]) -> None:
        """The open groups' claim times, from the ledger (every group still open is in it)."""
        self._claimed = claimed_at

    def overdue(self, now: float) -> List[str]:
        """Open groups claimed more than the deadline before `now`, by the last read."""
        cutoff = now - self.deadline_s()
        return [group for group, at in self._claimed.items() if at < cutoff and group not in self._expired]

    def expired(self, group_id: str) -> None:
        if group_id in self._claimed:
            self._expired[group_id] = self._claimed[group_id]

    def completed(self, group_ids: List[str], now: float) -> None:
        """Groups whose last sample was scored at `now` (an expired one's late samples included)."""
        for group_id in group_ids:
            claimed = self._expired.pop(group_id, None) or self._claimed.get(group_id)
            if claimed is not None:
                self.longest_s = max(self.longest_s, now - claimed)
