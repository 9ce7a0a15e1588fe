"""Rollout capacity that comes and goes while the RL stage runs.

A policy whose `rollout.max_workers` is above `rollout.num_workers` keeps its `num_workers` rollout workers
(Ray restarts those where they die) and adds one more whenever the cluster has room for it: the CPUs, GPUs
and `rollout.resources` a worker asks for, free, as when a node joins. It grows to `max_workers`, one
worker at a time (the next once the last answers). An added worker runs where Ray placed it and is not
restarted: when its process or its node goes away it leaves, and the groups it had started but not yet
submitted end as abandoned, their prompts issued again (`GroupSchedule.taken_over`); what it submitted is in
the reward queue already. The supervisor runs an added worker's loop like any other (`Supervisor.start` with
`on_leave`).
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional, Tuple

import ray
from ray._private.state import actors, available_resources_per_node  # Ray's developer API: placement, free room

from rlplatform.job.workers import PolicyWorkers
from rlplatform.scheduling.groups import GroupSchedule

CHECK_EVERY_S = 1.0  # between two looks at the cluster's free resources


class ElasticRollout:
    """One policy's added rollout workers: started while the cluster has room, up to `rollout.max_workers`."""

    def __init__(self, workers: PolicyWorkers, schedule: GroupSchedule, start_loop: Callable,
                 note: Callable[[str], None]) -> None:
        """`start_loop(kind, name, actor, on_leave)`: the supervisor's; `note`: tells the job's log and W&B."""
        rollout = workers.config.rollout
        self.workers, self.schedule, self.start_loop, self.note = workers, schedule, start_loop, note
        self.room = {"CPU": rollout.num_cpus, "GPU": workers.plan.rollout_gpus, **rollout.resources}  # what one worker asks Ray for
        self.most = rollout.max_workers or rollout.num_workers
        self._next_index = rollout.num_workers + 1  # index num_workers is the evaluator's
        self._starting: Optional[Tuple[object, ray.ObjectRef]] = None  # the newest added worker, its construction
        self._looked_at = 0.0
        self.joined = 0
        self.left = 0
        self.groups_reissued = 0

    def check(self) -> None:
        """Add a worker where the cluster has room for one and the policy has fewer than `max_workers`."""
        if len(self.workers.rollout) >= self.most or time.monotonic() - self._looked_at < CHECK_EVERY_S:
            return
        self._looked_at = time.monotonic()
        if self._starting is not None:
            if not ray.wait([self._starting[1]], timeout=0)[0]:
                return
            self._starting = None
        if not any(fits(self.room, free) for free in available_resources_per_node().values()):
            return
        index, self._next_index = self._next_index, self._next_index + 1
        actor = self.workers.add_rollout(index=index)
        self._starting = actor, actor.__ray_ready__.remote()
        self.workers.rollout.append(actor)
        self.joined += 1
        name = f"{self.workers.name}-{index}"
        self.start_loop("rollout", name, actor, lambda: self._leave(actor, index, name))
        self.note(f"rollout worker {name} joined: the cluster had room for it ({len(self.workers.rollout)} of at most "
                  f"{self.most} rollout workers of policy '{self.workers.name}')")

    def cancel_pending(self) -> None:
        """At the stage's end: an added worker Ray has not placed on a node yet (the room it was seen to have was
        taken meanwhile) is killed, so that its loop ends (it leaves) instead of being waited for; one placed and
        still starting sees the stop once it runs."""
        if self._starting is not None and not ray.wait([self._starting[1]], timeout=0)[0]:
            actor = self._starting[0]
            if not (actors(actor._actor_id.hex()).get("Address") or {}).get("Port"):  # no worker process holds it
                ray.kill(actor, no_restart=True)
        self._starting = None

    def _leave(self, actor, index: int, name: str) -> None:
        self.workers.rollout.remove(actor)
        self.left += 1
        reissued = self.schedule.taken_over(index)
        self.groups_reissued += reissued
        self.note(f"rollout worker {name} left (its process or node went away): the {reissued} groups it had not "
                  f"submitted are issued again; policy '{self.workers.name}' has {len(self.workers.rollout)} rollout "
                  f"workers now")

    def figures(self) -> Dict[str, int]:
        """The summary's `rollout_workers_*` counts."""
        return {"rollout_workers_joined": self.joined, "rollout_workers_left": self.left,
                "rollout_groups_reissued": self.groups_reissued}


def fits(needed: Dict[str, float], available: Dict[str, float]) -> bool:
    """Whether a node with resources `available` free holds one actor asking for `needed`."""
    return all(available.get(name, 0.0) >= amount - 1e-9 for name, amount in needed.items() if amount > 0)


def elastic_policies(policies: List[PolicyWorkers]) -> List[PolicyWorkers]:
    """The policies whose rollout workers may grow past `rollout.num_workers`."""
    return [p for p in policies if (p.config.rollout.max_workers or 0) > p.config.rollout.num_workers]
