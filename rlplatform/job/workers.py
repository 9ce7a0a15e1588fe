"""A policy's workers as the job drives them: learner ranks, rollout workers, the weight store,
the gate and the evaluator (`PolicyWorkers`), and `publish`, which streams a new version to them.

The controller builds these; the SFT and RL stages use them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import ray
from ray.exceptions import RayActorError

from rlplatform.config import EvalConfig, PolicyConfig, RewardSpec
from rlplatform.job.supervision import MAX_RESTARTS, Revival
from rlplatform.learners.group import LearnerGroup
from rlplatform.tokenization import Prompt
from rlplatform.transport.deadlines import EVAL_TIMEOUT_S, WEIGHTS_TIMEOUT_S, JobFailed, deadline_get
from rlplatform.transport.reward_queue import PolicyKeys
from rlplatform.transport.staleness import RolloutGate


class Evaluator:
    """A spare rollout worker that evaluates held-out prompts, scored by the job's rewards, without
    stopping training. Results are the figures of `rlplatform.monitoring.evaluation`.

    Ray restarts its actor when its process dies; the evaluation it was running starts again once
    the actor answers."""

    def __init__(self, actor, prompts: List[Prompt], config: EvalConfig, rewards: List[RewardSpec],
                 imports: List[str]) -> None:
        self.actor, self.prompts, self.config = actor, prompts, config
        self.rewards, self.imports = rewards, imports
        self._pending = None
        self._revival: Optional[Revival] = None  # the actor died: it is restarting
        self.last_accuracy: Optional[float] = None  # pass@1 of the newest finished evaluation
        self.restarts = 0

    def _call(self):
        return self.actor.evaluate_latest.remote(self.prompts, self.config, self.rewards, self.imports)

    def run_now(self) -> Tuple[int, Dict]:
        if self._revival is not None:  # died during a background evaluation
            self._revival.wait()
            self._revival = None
        while True:
            try:
                version, figures = deadline_get(self._call(), "the evaluator", EVAL_TIMEOUT_S)
                self.last_accuracy = figures["accuracy"]
                return version, figures
            except RayActorError:
                self._restarted()
                self._revival.wait()
                self._revival = None

    def score(self, snapshot: ray.ObjectRef) -> float:
        """Held-out pass@1 of weights not published as a version (an SFT stage in progress)."""
        figures = deadline_get(self.actor.evaluate_snapshot.remote(snapshot, self.prompts, self.config, self.rewards,
                                                                   self.imports), "the evaluator", EVAL_TIMEOUT_S)
        return figures["accuracy"]

    def start(self) -> None:
        """Begin evaluating the newest weights in the background, unless one is under way."""
        if self._pending is None and self._revival is None:
            self._pending = self._call()

    def poll(self) -> Optional[Tuple[int, Dict]]:
        """(version, figures) of a finished background evaluation, else None."""
        if self._revival is not None and self._revival.ready():
            self._revival, self._pending = None, self._call()
        if self._pending is None or not ray.wait([self._pending], timeout=0)[0]:
            return None
        try:
            version, figures = ray.get(self._pending)
        except RayActorError:
            self._restarted()
            self._pending = None
            return None
        self.last_accuracy = figures["accuracy"]
        self._pending = None
        return version, figures

    def _restarted(self) -> None:
        self.restarts += 1
        if self.restarts > MAX_RESTARTS:
            raise JobFailed(f"the evaluator died {self.restarts} times; see the Ray logs") from None
        self._revival = Revival(self.actor, "the evaluator")


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
    sft_rows: List[Dict]  # the training rows whose prompts fit `data.max_prompt_tokens`
    data: Dict[str, int]  # rows kept and skipped as too long, for the summary

    @property
    def name(self) -> str:
        return self.config.name


def publish(workers: PolicyWorkers, client, version: int, snapshot=None) -> float:
    """Stream the policy's weights as `version`: `snapshot` when the learner step streamed them (an
    object ref for the weight store, or the version already broadcast), else the learner's current
    weights. The version goes to Redis last. Returns the seconds it took."""
    start = time.perf_counter()
    sent = snapshot if snapshot is not None else workers.learner.stream_weights(version)
    if isinstance(sent, ray.ObjectRef):
        deadline_get(workers.weight_store.publish.remote(version, [sent]),
                     f"the weight store of policy '{workers.name}'", WEIGHTS_TIMEOUT_S)
    client.set(workers.keys.version, version)
    return time.perf_counter() - start
