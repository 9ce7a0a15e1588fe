"""Supervision of the job's long-running worker loops (rollout and reward workers).

Workers run as Ray actors that Ray restarts when their process dies; `Supervisor` notices a
loop that ended with the actor's death, waits until Ray has restarted the actor (`Revival`: calls
made meanwhile fail at once), calls the loop again and counts the restart by kind; a worker added while
the stage ran (`rlplatform.job.elastic`) is not restarted but leaves. The loops
report through Redis, not their return values. Remote waits go through `rlplatform.transport.deadlines`.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import KW_ONLY, dataclass
from typing import Callable, List, Optional, Sequence

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

from rlplatform.monitoring.watchdog import HangRule, WorkerWatchdog
from rlplatform.transport.deadlines import Heartbeats, JobFailed, WorkerHung, deadline_get

MAX_RESTARTS = 10  # per actor: Ray gives up on an actor that died this often, and the job fails
PROBE_S = 0.5  # between readiness probes of an actor Ray is restarting
WATCH_EVERY_S = 2.0  # between two looks at the services' beats while the job waits on an evaluation


@dataclass
class RestartDeadline:
    """How long an actor Ray restarts may take to answer again: the hang rule's deadline (`monitoring.hang_factor`
    times, at least `monitoring.hang_floor_s`) on the job's measured start-up until its workers were constructed,
    `start_s` (the floor alone until the job has measured it)."""
    rule: HangRule
    start_s: float = 0.0

    @property
    def seconds(self) -> float:
        return self.rule.deadline_s(self.start_s)


class ServiceWatch:
    """The job's services (tool workers, serving from their construction) watched outside the RL loop, while the job
    waits on an evaluation whose episodes call them: a hung one is dumped, killed for Ray to restart it (its restart
    takes back the calls it held) and alerted, as the RL loop's watchdog does. `actors` are set once they started;
    with the watchdog off (`rule` None) nothing is watched."""

    def __init__(self, rule: Optional[HangRule], run_dir: str, heartbeats: Heartbeats,
                 alert: Callable[[str], None]) -> None:
        self.watchdog = WorkerWatchdog(rule, run_dir, lambda actor_id: restart_among(self.actors, actor_id)) \
            if rule else None
        self.heartbeats, self.alert = heartbeats, alert
        self.actors: List = []
        self._last = 0.0

    def check(self) -> None:
        """Every WATCH_EVERY_S at most: handle the services hung since their last beat."""
        if self.watchdog is None or not self.actors or time.monotonic() - self._last < WATCH_EVERY_S:
            return
        self._last = time.monotonic()
        ids = {actor._actor_id.hex() for actor in self.actors}
        for message in self.watchdog.check([beat for beat in self.heartbeats.beats() if beat.actor in ids]):
            self.alert(message)


def restart_among(actors: Sequence, actor_id: str) -> bool:
    """Kill the one of `actors` whose Ray actor id (hex) is `actor_id`, for Ray to restart it; False where none is."""
    for actor in actors:
        if actor._actor_id.hex() == actor_id:
            ray.kill(actor, no_restart=False)
            return True
    return False


class Revival:
    """An actor whose process died, while Ray restarts it: calls made meanwhile fail at once with
    `ActorUnavailableError`, so it is probed (`__ray_ready__`) every PROBE_S until it answers, for at most
    `timeout_s`."""

    def __init__(self, actor, what: str, timeout_s: float) -> None:
        self.actor, self.what, self.timeout_s = actor, what, timeout_s
        self._probe: Optional[ray.ObjectRef] = None
        self._next_at = 0.0
        self._deadline = time.monotonic() + timeout_s

    def ready(self) -> bool:
        """Whether the restarted actor answers (never blocks)."""
        if self._probe is None:
            if time.monotonic() < self._next_at:
                return False
            self._probe = self.actor.__ray_ready__.remote()
        if not ray.wait([self._probe], timeout=0)[0]:
            return False
        probe, self._probe = self._probe, None
        try:
            ray.get(probe)
            return True
        except ActorUnavailableError:
            if time.monotonic() > self._deadline:
                raise WorkerHung(f"{self.what} died and was not back within {self.timeout_s:.0f}s (its restart "
                                 f"deadline: monitoring.hang_factor x the workers' start-up); see the Ray "
                                 f"logs") from None
            self._next_at = time.monotonic() + PROBE_S
            return False
        except ActorDiedError as err:
            raise JobFailed(f"{self.what} died and Ray did not restart it (at most {MAX_RESTARTS} restarts "
                            f"per worker): {str(err).splitlines()[0]}") from None

    def wait(self) -> None:
        while not self.ready():
            time.sleep(0.05)


@dataclass
class _Loop:
    kind: str  # rollout, reward, teacher
    name: str
    actor: object
    ref: Optional[ray.ObjectRef]
    revival: Optional[Revival] = None  # set from the actor's death until it answers again
    _: KW_ONLY
    on_leave: Optional[Callable[[], None]] = None  # an added worker Ray does not restart: told when it dies


class Supervisor:
    """The worker loops of a stage: restarts dead ones, collects their results at the end."""

    def __init__(self, note: Callable[[str], None], restart: RestartDeadline, services: Sequence = ()) -> None:
        """`restart`: how long a dead worker's actor may take to be back; `services`: actors that serve from their
        construction, with no loop to run (tool workers); Ray restarts them whole."""
        self.note, self.restart = note, restart
        self.restarts: Counter = Counter()
        self._loops: List[_Loop] = []
        self._services = list(services)

    def start(self, kind: str, name: str, actor, on_leave: Optional[Callable[[], None]] = None) -> None:
        """Run `actor`'s loop. With `on_leave`, the actor is one Ray does not restart (`rlplatform.job.elastic`):
        its death is no restart, it leaves the stage and `on_leave` is told."""
        self._loops.append(_Loop(kind, name, actor, actor.run.remote(), on_leave=on_leave))

    def check(self) -> None:
        """Restart the loop of every worker whose actor died once Ray has restarted the actor; a loop
        that returned early is an error."""
        for loop in self._loops:
            if loop.revival is not None and loop.revival.ready():
                loop.revival, loop.ref = None, loop.actor.run.remote()
        refs = [loop.ref for loop in self._loops if loop.revival is None]
        finished = ray.wait(refs, num_returns=len(refs), timeout=0)[0] if refs else []
        for loop in list(self._loops):  # a worker that leaves is taken out
            if loop.revival is None and loop.ref in finished:
                self._handle_finished(loop)

    def _handle_finished(self, loop: _Loop) -> None:
        try:
            ray.get(loop.ref)
        except RayActorError as err:
            if loop.on_leave is not None:
                self._leave(loop)
                return
            self.restarts[loop.kind] += 1
            if self.restarts[loop.kind] > MAX_RESTARTS * max(1, self._count(loop.kind)):
                raise RuntimeError(f"{loop.kind} worker {loop.name} keeps dying: {err}") from None
            self.note(f"{loop.kind} worker {loop.name} died; restarting it (restart {self.restarts[loop.kind]} "
                      f"of {loop.kind} workers)")
            loop.revival = Revival(loop.actor, f"{loop.kind} worker {loop.name}", self.restart.seconds)
            return
        raise RuntimeError(f"{loop.kind} worker {loop.name} stopped before the job asked it to")

    def _leave(self, loop: _Loop) -> None:
        self._loops.remove(loop)
        loop.on_leave()

    def restart_hung(self, actor_id: str) -> bool:
        """Kill the actor `actor_id` (Ray actor id, hex) of a hung worker loop or service, so that Ray restarts it
        (and `check` runs a loop again); False where the stage holds no such actor."""
        return restart_among([loop.actor for loop in self._loops] + self._services, actor_id)

    def _count(self, kind: str) -> int:
        return sum(loop.kind == kind for loop in self._loops)

    def wait_ended(self, kind: str, timeout_s: float) -> None:
        """Wait for every `kind` worker's loop to end, once the stop flag is set. The loops' figures
        are on Redis, so a loop that dies while stopping is simply run again to see the flag."""
        deadline = time.monotonic() + timeout_s
        for loop in [loop for loop in self._loops if loop.kind == kind]:
            while True:
                if loop.revival is not None:  # died while stopping: its restart sees the stop flag at once
                    loop.revival.wait()
                    loop.revival, loop.ref = None, loop.actor.run.remote()
                try:
                    deadline_get(loop.ref, f"{kind} worker {loop.name}", max(1.0, deadline - time.monotonic()))
                    break
                except RayActorError:
                    if loop.on_leave is not None:  # an added worker that dies now leaves, as it would before
                        self._leave(loop)
                        break
                    self.restarts[kind] += 1
                    self.note(f"{kind} worker {loop.name} died while the stage ended; restarting it to finish what it "
                              f"held (restart {self.restarts[kind]} of {kind} workers)")
                    loop.revival = Revival(loop.actor, f"{kind} worker {loop.name}", self.restart.seconds)
