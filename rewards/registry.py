"""The reward registry: names a job's YAML can use, mapped to reward functions.

A reward function takes a `Sample` and returns a float. Built-in rewards register
themselves here when `rlplatform.rewards` is imported; `resolve` turns a job's reward list
into callables, failing with the list of known names on a misspelling.
"""

from __future__ import annotations

from typing import Callable, Dict, List

from rlplatform.config import RewardSpec
from rlplatform.samples import Sample

RewardFn = Callable[[Sample], float]

REWARDS: Dict[str, RewardFn] = {}


class UnknownReward(KeyError):
    def __str__(self) -> str:
        return self.args[0]


def register(name: str, fn: RewardFn) -> RewardFn:
    REWARDS[name] = fn
    return fn


def resolve(specs: List[RewardSpec]) -> List[tuple]:
    """[(name, weight, fn)] for a job's reward list."""
    resolved = []
    for i, spec in enumerate(specs):
        if spec.name not in REWARDS:
            raise UnknownReward(f"rewards[{i}].name: unknown reward '{spec.name}'; "
                                f"known: {', '.join(sorted(REWARDS))}")
        resolved.append((spec.name, spec.weight, REWARDS[spec.name]))
    return resolved
