"""Rollout capacity that comes and goes while the RL stage runs.

A policy whose `rollout.max_workers` is above `rollout.num_workers` keeps its `num_workers` rollout workers
(Ray restarts those where they die) and adds one more whenever the cluster has room for it: the CPUs, GPUs
and `rollout.resources` a worker asks for, free, as when a node joins. It grows to `max_workers`, one
worker at a time (the next once the last answers). Any policy also takes the rollout workers a user attaches
by the job's name from a node of its cluster (`rlp rollout-worker --job NAME`: `AttachDesk`), on that node,
for as long as the command runs (its lease, `transport.worker_attach`). An added or attached worker runs where
it was placed and is not restarted: when its process or its node goes away, or its command ends, it leaves,
and the groups it had started but not yet submitted end as abandoned, their prompts issued again
(`GroupSchedule.taken_over`); what it submitted is in the reward queue already. The supervisor runs such a
worker's loop like any other (`Supervisor.start` with `on_leave`).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Callable, Dict, List, Optional, Tuple

import ray
from ray._private.state import actors, available_resources_per_node  # Ray's developer API: placement, free room

from rlplatform.job.workers import PolicyWorkers
from rlplatform.scheduling.groups import GroupSchedule
from rlplatform.transport.deadlines import Heartbeats, rollout_worker_label
from rlplatform.transport.side_channels import AttachAnswer, AttachRequest
from rlplatform.transport.worker_attach import AttachRequests

CHECK_EVERY_S = 1.0  # between two looks at the cluster's free resources, the attach requests and their leases


class ElasticRollout:
    """One policy's added rollout workers: started while the cluster has room, up to `rollout.max_workers`, and
    those attached by `rlp rollout-worker`, each until its command's lease lapses."""

    def __init__(self, job: str, workers: PolicyWorkers, schedule: GroupSchedule, start_loop: Callable,
                 note: Callable[[str], None], *, heartbeats: Heartbeats) -> None:
        """`job`: the job's name; `start_loop(kind, name, actor, on_leave)`: the supervisor's; `note`: tells the
        job's log and W&B."""
        rollout = workers.config.rollout
        self.job, self.workers, self.schedule, self.start_loop, self.note = job, workers, schedule, start_loop, note
        self.heartbeats = heartbeats  # a worker that left is no longer watched
        # what one worker asks Ray for
        self.room = {"CPU": rollout.num_cpus, "GPU": workers.plan.rollout_gpus, **rollout.resources}
        self.most = rollout.max_workers or rollout.num_workers
        self._next_index = rollout.num_workers + 1  # index num_workers is the evaluator's
        self._starting: Optional[Tuple[object, ray.ObjectRef]] = None  # the newest added worker, its construction
        self._placing: List[object] = []  # every added or attached worker: those still unplaced at the end are killed
        self._attached: Dict[str, Tuple[Callable[[], bool], List[object]]] = {}  # request -> (held, its workers)
        self._detached: set = set()  # the attached workers stopped because their command ended
        self._looked_at = 0.0
        self.joined = 0
        self.left = 0
        self.groups_reissued = 0

    def check(self) -> None:
        """Stop the attached workers whose command ended; add a worker where the cluster has room for one and the
        policy has fewer than `max_workers`; once a `CHECK_EVERY_S` (each look reads Redis and Ray's state)."""
        if time.monotonic() - self._looked_at < CHECK_EVERY_S:
            return
        self._looked_at = time.monotonic()
        for request, (held, started) in list(self._attached.items()):
            if not held():
                del self._attached[request]
                for actor in started:
                    self._detached.add(actor)
                    ray.kill(actor, no_restart=True)  # its loop ends in an actor error: it leaves
        if len(self.workers.rollout) >= self.most:
            return
        if self._starting is not None:
            if not ray.wait([self._starting[1]], timeout=0)[0]:
                return
            self._starting = None
        if not any(fits(self.room, free) for free in available_resources_per_node().values()):
            return
        actor, index = self._add()
        self._starting = actor, actor.__ray_ready__.remote()
        self.note(f"rollout worker {self.workers.name}-{index} joined: the cluster had room for it "
                  f"({len(self.workers.rollout)} of at most {self.most} rollout workers of policy "
                  f"'{self.workers.name}')")

    def attach(self, request: AttachRequest, node_id: str, held: Callable[[], bool]) -> AttachAnswer:
        """Start `request.workers` rollout workers on the node `node_id`, stopped once `held()` is false."""
        started = [self._add(node_id) for _ in range(request.workers)]
        self._attached[request.request] = held, [actor for actor, _ in started]
        names = [f"{self.workers.name}-{index}" for _, index in started]
        self.note(f"rollout worker{'s' * (len(names) > 1)} {', '.join(names)} attached on node {node_id[:12]} by "
                  f"`rlp rollout-worker` (request {request.request}); policy '{self.workers.name}' has "
                  f"{len(self.workers.rollout)} rollout workers now")
        return AttachAnswer(tuple(f"{self.job}-{self.workers.name}-rollout-{index}" for _, index in started))

    def _add(self, node_id: Optional[str] = None) -> Tuple[object, int]:
        """A worker added (at `node_id`, or where Ray places it): started, its loop run, and (actor, its index)."""
        index, self._next_index = self._next_index, self._next_index + 1
        actor = self.workers.add_rollout(index=index, node_id=node_id)
        self.workers.rollout.append(actor)
        self._placing.append(actor)
        self.joined += 1
        name = f"{self.workers.name}-{index}"
        self.start_loop("rollout", name, actor, lambda: self._leave(actor, index, name))
        return actor, index

    def cancel_pending(self) -> None:
        """At the stage's end: an added worker Ray has not placed on a node yet (the room it was seen to have was
        taken meanwhile, or the node it was attached on is full) is killed, so that its loop ends (it leaves)
        instead of being waited for; one placed and still starting sees the stop once it runs."""
        for actor in self._placing:
            placed = (actors(actor._actor_id.hex()).get("Address") or {}).get("Port")  # a worker process holds it
            if actor in self.workers.rollout and not placed:
                ray.kill(actor, no_restart=True)
        self._placing, self._starting = [], None

    def _leave(self, actor, index: int, name: str) -> None:
        self.workers.rollout.remove(actor)
        self.heartbeats.leave(rollout_worker_label(index, self.workers.name))
        self.left += 1
        reissued = self.schedule.taken_over(index)
        self.groups_reissued += reissued
        why = "its `rlp rollout-worker` ended" if actor in self._detached else "its process or node went away"
        self.note(f"rollout worker {name} left ({why}): the {reissued} groups it had not submitted are issued again; "
                  f"policy '{self.workers.name}' has {len(self.workers.rollout)} rollout workers now")

    def figures(self) -> Dict[str, int]:
        """The summary's `rollout_workers_*` counts, where workers may come and go or came."""
        if self.most <= self.workers.config.rollout.num_workers and not self.joined:
            return {}
        return {"rollout_workers_joined": self.joined, "rollout_workers_left": self.left,
                "rollout_groups_reissued": self.groups_reissued}


class AttachDesk:
    """The job's end of `rlp rollout-worker`: each new request answered, its workers started on its node by the
    policy it names (`ElasticRollout.attach`), or refused with the reason."""

    def __init__(self, requests: AttachRequests, policies: Dict[str, ElasticRollout],
                 note: Callable[[str], None]) -> None:
        self.requests, self.policies, self.note = requests, policies, note
        self._looked_at = 0.0

    def check(self) -> None:
        if time.monotonic() - self._looked_at < CHECK_EVERY_S:
            return
        self._looked_at = time.monotonic()
        new, malformed = self.requests.new()
        for line in malformed:
            self.note(line)
        for request in new:
            if not self.requests.held(request):  # its command ended before the job looked
                continue
            policy, refused = self._policy(request)
            node_id, refused = (None, refused) if refused else _node(request)
            if refused:
                self.note(f"attach request {request.request} refused: {refused}")
                self.requests.answer(request, AttachAnswer((), refused))
                continue
            self.requests.answer(request, policy.attach(request, node_id, partial(self.requests.held, request)))

    def _policy(self, request: AttachRequest) -> Tuple[Optional[ElasticRollout], str]:
        names = ", ".join(self.policies)
        if not request.policy and len(self.policies) > 1:
            return None, f"the job trains policies {names}: name one with --policy"
        name = request.policy or next(iter(self.policies))
        if name not in self.policies:
            return None, f"the job has no policy {name!r} (its policies: {names})"
        if request.workers < 1:
            return None, f"asked for {request.workers} workers"
        transport = self.policies[name].workers.plan.transport
        if not transport.snapshots_in_store:
            return None, (f"policy {name!r} streams its weights by {transport.name}, whose receivers are fixed at the "
                          f"start: workers that join need weights.transport: object_store")
        return self.policies[name], ""


def _node(request: AttachRequest) -> Tuple[Optional[str], str]:
    """(the id of the live node the request names, or runs at), or (None, why none)."""
    alive = [node for node in ray.nodes() if node["Alive"]]
    if request.node_id:
        if any(node["NodeID"] == request.node_id for node in alive):
            return request.node_id, ""
        return None, f"no live node {request.node_id} in the job's Ray cluster"
    there = [node["NodeID"] for node in alive if node["NodeManagerAddress"] == request.node_ip]
    if len(there) == 1:
        return there[0], ""
    if not there:
        return None, (f"no node of the job's Ray cluster runs at {request.node_ip}: join it first "
                      f"(`ray start --address=...`), or give --node-id")
    return None, f"{len(there)} nodes of the job's Ray cluster run at {request.node_ip}: give --node-id (one of " \
                 f"{', '.join(there)})"


def fits(needed: Dict[str, float], available: Dict[str, float]) -> bool:
    """Whether a node with resources `available` free holds one actor asking for `needed`."""
    return all(available.get(name, 0.0) >= amount - 1e-9 for name, amount in needed.items() if amount > 0)

