"""Supervision of the job's long-running worker loops (rollout and reward workers).

Workers run as Ray actors that Ray restarts when their process dies; `Supervisor` notices a
loop that ended with the actor's death, calls the loop again on the restarted actor and counts
the restart by kind. The loops report through Redis, not their return values. Remote waits go through `rlplatform.transport.deadlines`.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, List

import ray
from ray.exceptions import RayActorError

from rlplatform.transport.deadlines import deadline_get

MAX_RESTARTS = 10  # per actor: Ray gives up on an actor that died this often, and the job fails


@dataclass
class _Loop:
    kind: str  # rollout, reward
    name: str
    actor: object
    ref: ray.ObjectRef


class Supervisor:
    """The worker loops of a stage: restarts dead ones, collects their results at the end."""

    def __init__(self, note: Callable[[str], None]) -> None:
        self.note = note
        self.restarts: Counter = Counter()
        self._loops: List[_Loop] = []

    def start(self, kind: str, name: str, actor) -> None:
        self._loops.append(_Loop(kind, name, actor, actor.run.remote()))

    def check(self) -> None:
        """Restart the loop of every worker whose actor died; a loop that returned early is an error."""
        refs = [loop.ref for loop in self._loops]
        finished, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        for loop in self._loops:
            if loop.ref in finished:
                self._handle_finished(loop)

    def _handle_finished(self, loop: _Loop) -> None:
        try:
            ray.get(loop.ref)
        except RayActorError as err:
            self.restarts[loop.kind] += 1
            if self.restarts[loop.kind] > MAX_RESTARTS * max(1, self._count(loop.kind)):
                raise RuntimeError(f"{loop.kind} worker {loop.name} keeps dying: {err}") from None
            self.note(f"{loop.kind} worker {loop.name} died; restarted it (restart {self.restarts[loop.kind]} "
                      f"of {loop.kind} workers)")
            loop.ref = loop.actor.run.remote()
            return
        raise RuntimeError(f"{loop.kind} worker {loop.name} stopped before the job asked it to")

    def _count(self, kind: str) -> int:
        return sum(loop.kind == kind for loop in self._loops)

    def wait_ended(self, kind: str, timeout_s: float) -> None:
        """Wait for every `kind` worker's loop to end, once the stop flag is set. The loops' figures
        are on Redis, so a loop that dies while stopping is simply run again to see the flag."""
        deadline = time.monotonic() + timeout_s
        for loop in (loop for loop in self._loops if loop.kind == kind):
            while True:
                try:
                    deadline_get(loop.ref, f"{kind} worker {loop.name}", max(1.0, deadline - time.monotonic()))
                    break
                except RayActorError:
                    self.restarts[kind] += 1
                    loop.ref = loop.actor.run.remote()
