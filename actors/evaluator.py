"""The evaluator's Ray actor: the job's spare rollout worker, which scores held-out prompts, in a
process that takes its CPU priority (`eval.priority`) before it loads anything.

Ray imports an actor's module before its constructor runs, and the rollout worker's module loads
torch and transformers: seconds of CPU at the priority the process started with. This module loads
neither; its constructor lowers the process's priority first, then imports and builds the rollout
worker. At `eval.priority: idle` the evaluator's whole start-up so runs on the CPU time the rest of
the job leaves, beside RL's first steps. Each answer names the process that gave it (an id, whether Ray started
it as a restart), so the job sees a restart that happened between two evaluations. Each process records where it
runs on Redis before anything else (`PolicyKeys.evaluator_process`), so the job can dump the stacks of one that
hangs even before it first answered.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Dict, List, Tuple

import ray
import redis
from ray._private.state import actors  # the GCS actor table (runtime_context's own check warns of a deprecation)

from rlplatform.actor_classes import LazyActorClass
from rlplatform.actors.rollout_spec import RolloutSpec
from rlplatform.priority import set_cpu_priority
from rlplatform.transport.deadlines import this_process
from rlplatform.transport.keys import PolicyKeys


class EvaluatorWorker:
    """A `RolloutWorker` built after the process took its spec's priority; it serves what the job asks of its
    evaluator, each answer as ((this process's id, whether it is a restart), the answer)."""

    def __init__(self, spec: RolloutSpec) -> None:
        try:  # for the job's hang alert: a Redis that does not answer now leaves it without the pid, nothing more
            with redis.Redis.from_url(spec.redis_url, socket_timeout=5) as client:
                client.set(PolicyKeys(spec.run, spec.policy).evaluator_process, json.dumps(this_process()))
        except redis.RedisError:
            pass
        set_cpu_priority(spec.priority)
        from rlplatform.actors.rollout import RolloutWorker

        self.worker = RolloutWorker(spec)
        self.instance = (uuid.uuid4().hex, started_as_restart())

    def join_weights(self, *args, **kwargs) -> None:
        self.worker.join_weights(*args, **kwargs)

    def evaluate_snapshot(self, snapshot: Dict, prompts: List, config, rewards: List, imports: List[str]
                          ) -> Tuple[Tuple[str, bool], Dict]:
        return self.instance, self.worker.evaluate_snapshot(snapshot, prompts, config, rewards, imports)

    def evaluate_latest(self, prompts: List, config, rewards: List, imports: List[str]) -> Tuple[Tuple[str, bool], Any]:
        return self.instance, self.worker.evaluate_latest(prompts, config, rewards, imports)


EvaluatorActor = LazyActorClass(EvaluatorWorker)


def started_as_restart() -> bool:
    """Whether Ray restarted this actor (its evaluations then start from a new process)."""
    info = actors(actor_id=ray.get_runtime_context().get_actor_id())
    return bool(info) and info["NumRestarts"] != 0
