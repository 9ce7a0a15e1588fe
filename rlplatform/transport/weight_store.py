"""The weight store: one small Ray actor per policy holding the published weights engines still need.

The learner publishes (version, [update ref]) to it and rollout workers ask it for what brings them
to the newest version; updates themselves are made and read by `weights` and `weight_deltas`. With
full versions only, that is the newest update; with delta sync (`weights.delta`) the store keeps the
last full version and every delta since, so an engine that missed some versions replays them in
order. This module imports no torch, so the store's process starts in a fraction of the time a
worker's does.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import ray

from rlplatform.actor_classes import LazyActorClass

Update = Tuple[int, List[ray.ObjectRef]]  # (version, [ref of what the transport put in the object store])


def full_version(version: int, full_every: int) -> bool:
    """Whether delta sync sends `version` whole (every `full_every`-th; without deltas, every version)."""
    return not full_every or version % full_every == 0


class WeightStore:
    """Holds the newest full version of one policy, and with delta sync the deltas published after it."""

    def __init__(self, full_every: int = 0) -> None:
        self.full_every = full_every  # weights.delta_full_every when deltas are on, else 0
        self._chain: List[Update] = []  # a full version, then the deltas after it, oldest first

    def publish(self, version: int, refs: List[ray.ObjectRef]) -> None:
        if self._chain and version <= self._chain[-1][0]:
            return
        if not self._chain or full_version(version, self.full_every):  # the learner sent it whole
            self._chain = []
        self._chain.append((version, refs))

    def newer_than(self, version: int) -> Optional[List[Update]]:
        """The updates, oldest first, that bring an engine holding `version` to the newest: the deltas
        after it, or the full version and every delta since when it holds an older one; None when it
        holds the newest."""
        if not self._chain or self._chain[-1][0] <= version:
            return None
        if version < self._chain[0][0]:
            return list(self._chain)
        return [update for update in self._chain if update[0] > version]


WeightStoreActor = LazyActorClass(WeightStore, num_cpus=0)
