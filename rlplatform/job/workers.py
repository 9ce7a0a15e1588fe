"""A policy's workers as the job drives them: learner ranks, rollout workers, the weight store,
the gate and the evaluator (`PolicyWorkers`), and `publish`, which streams a new version to them.

The controller builds these; the SFT and RL stages use them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import ray

from rlplatform.config import EvalConfig, PolicyConfig
from rlplatform.learners.group import LearnerGroup
from rlplatform.transport.reward_queue import PolicyKeys
from rlplatform.transport.staleness import RolloutGate


class Evaluator:
    """A spare rollout worker that measures held-out greedy accuracy without stopping training."""

    def __init__(self, actor, rows: List[Dict], config: EvalConfig) -> None:
        self.actor, self.rows, self.config = actor, rows, config
        self._pending = None
        self.last_accuracy: Optional[float] = None

    def _call(self):
        return self.actor.evaluate_latest.remote(self.rows, self.config.max_new_tokens, self.config.batch_size)

    def run_now(self) -> Tuple[int, float]:
        version, self.last_accuracy = ray.get(self._call())
        return version, self.last_accuracy

    def score(self, snapshot: ray.ObjectRef) -> float:
        """Greedy accuracy of weights not published as a version (an SFT stage in progress)."""
        return ray.get(self.actor.evaluate_snapshot.remote(snapshot, self.rows, self.config.max_new_tokens,
                                                           self.config.batch_size))

    def start(self) -> None:
        """Begin evaluating the newest weights in the background, unless one is under way."""
        if self._pending is None:
            self._pending = self._call()

    def poll(self) -> Optional[Tuple[int, float]]:
        """(version, accuracy) of a finished background evaluation, else None."""
        if self._pending is None or not ray.wait([self._pending], timeout=0)[0]:
            return None
        version, self.last_accuracy = ray.get(self._pending)
        self._pending = None
        return version, self.last_accuracy


@dataclass
class PolicyWorkers:
    """One policy's actors and handles: learner ranks, rollout workers, weight store, evaluator."""
    config: PolicyConfig
    learner: LearnerGroup
    rollout: List  # RolloutActor handles
    weight_store: object  # WeightStore handle
    gate: RolloutGate
    evaluator: Evaluator
    keys: PolicyKeys

    @property
    def name(self) -> str:
        return self.config.name


def publish(workers: PolicyWorkers, client, version: int, snapshot: Optional[ray.ObjectRef] = None) -> float:
    """Stream the policy's weights as `version`: `snapshot` when the learner step made one, else the
    learner's current weights. Returns the seconds it took."""
    start = time.perf_counter()
    ref = snapshot if snapshot is not None else workers.learner.publish_weights()
    ray.get(workers.weight_store.publish.remote(version, [ref]))
    client.set(workers.keys.version, version)
    return time.perf_counter() - start
