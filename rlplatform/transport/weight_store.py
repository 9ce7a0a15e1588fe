"""The weight store: one small Ray actor per policy holding the newest published weight snapshot.

The learner publishes (version, [snapshot ref]) to it and rollout workers ask it for anything newer
than what they hold; snapshots themselves are made and read by `weights`. This module imports no
torch, so the store's process starts in a fraction of the time a worker's does.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import ray


@ray.remote(num_cpus=0)
class WeightStore:
    """Holds the newest published weights of one policy."""

    def __init__(self) -> None:
        self._version = -1
        self._refs: List[ray.ObjectRef] = []

    def publish(self, version: int, refs: List[ray.ObjectRef]) -> None:
        if version > self._version:
            self._version, self._refs = version, refs

    def newer_than(self, version: int) -> Optional[Tuple[int, List[ray.ObjectRef]]]:
        """(version, [snapshot ref]) when a newer snapshot than `version` exists."""
        if self._version > version:
            return self._version, self._refs
        return None
