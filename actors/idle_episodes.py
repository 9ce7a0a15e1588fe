"""Agent episodes the OpenAI bridge holds between their requests, and when an agent counts as gone.

An episode waits on its agent from each answer the bridge sends it (a turn's reply, a finish answered
429 or 410 and kept) to the agent's next request for it. The longest such wait so far sets the idle
deadline, as the watchdog's hang rule sets a worker's (`monitoring.hang_factor` times it, at least
`monitoring.hang_floor_s`). An episode idle past it is dropped from the bridge's memory: its agent
stopped or went away. Its id is remembered (the newest `REMEMBERED` of them), so a late request of
the agent is answered 410 instead of starting a new episode from the old conversation.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional, Set

from rlplatform.monitoring.watchdog import HangRule

REMEMBERED = 10_000  # expired episode ids kept to answer their agents' late requests


@dataclass(frozen=True)
class ExpiredEpisode:
    """An episode dropped for its agent's silence: who held it, for how long, against which deadline."""
    episode: str
    client: str  # the address its last request came from
    idle_s: float
    deadline_s: float

    def as_dict(self) -> Dict:
        return asdict(self)


class IdleEpisodes:
    def __init__(self, rule: Optional[HangRule], clock: Callable[[], float] = time.monotonic) -> None:
        """`rule`: the hang rule on the longest wait (None: no episode ever expires)."""
        self.rule, self.clock = rule, clock
        self.longest_wait_s = 0.0  # the longest an agent took to send an episode's next request
        self._answered: Dict[str, float] = {}  # held episodes: when their agent was last answered
        self._clients: Dict[str, str] = {}
        self._expired: "OrderedDict[str, None]" = OrderedDict()

    def deadline_s(self) -> float:
        return self.rule.deadline_s(self.longest_wait_s or self.rule.floor_s) if self.rule else math.inf

    def requested(self, episode: str) -> None:
        """The agent sent `episode`'s next request: its wait is measured."""
        answered = self._answered.pop(episode, None)
        if answered is not None:
            self.longest_wait_s = max(self.longest_wait_s, self.clock() - answered)

    def answered(self, episode: str, client: str) -> None:
        """The bridge answered a request of `episode`, which it still holds, from `client`."""
        self._answered[episode] = self.clock()
        self._clients[episode] = client

    def ended(self, episode: str) -> None:
        """The bridge no longer holds `episode` (finished, discarded, or its turn failed)."""
        self._answered.pop(episode, None)
        self._clients.pop(episode, None)

    def has_expired(self, episode: str) -> bool:
        return episode in self._expired

    def expire(self, busy: Set[str]) -> List[ExpiredEpisode]:
        """The held episodes idle past the deadline (none with a request in progress): forgotten here and
        returned, for the bridge to drop."""
        now, deadline = self.clock(), self.deadline_s()
        expired = [ExpiredEpisode(episode, self._clients.get(episode, ""), now - at, deadline)
                   for episode, at in self._answered.items() if now - at > deadline and episode not in busy]
        for gone in expired:
            self.ended(gone.episode)
            self._expired[gone.episode] = None
        while len(self._expired) > REMEMBERED:
            self._expired.popitem(last=False)
        return expired
