"""CPU priority of the job's processes.

Where actors share CPUs, the learner step is the job's critical path. Ray starts every worker
process at one niceness: a Ray the job starts itself, at the controller's (`ray_workers_at_our_niceness`;
Ray's own default, 15, would put the learner below the controller and Redis and leave little room
under it). Each producer calls `set_cpu_priority` with its `priority` setting as it starts: "low"
(rollout, reward and tool workers by default) runs a few niceness levels below the learner, "idle"
(the evaluator by default) at the lowest niceness, on what CPU time the rest leaves, "normal" as the
learner does.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator, List

LOW_LEVELS = 4  # niceness levels "low" adds (up to 19, the lowest priority): CFS gives it 0.4 of a normal share
MAX_NICE = 19
RAY_WORKER_NICENESS = "RAY_worker_niceness"  # read by the raylet Ray starts, for the workers it spawns


def set_cpu_priority(priority: str) -> None:
    """Lower this process's CPU priority to `priority` on every thread (on Linux niceness is per thread,
    inherited by the threads each one starts): "low" adds LOW_LEVELS niceness levels, "idle" takes 19,
    the lowest niceness, "normal" leaves it. Neither can be undone without privileges; a process at 19
    still gets a small share of a busy CPU, so an evaluation the job waits for never stalls."""
    if priority == "normal":
        return
    for thread in _threads():
        try:
            lowered = MAX_NICE if priority == "idle" else os.getpriority(os.PRIO_PROCESS, thread) + LOW_LEVELS
            os.setpriority(os.PRIO_PROCESS, thread, min(MAX_NICE, lowered))
        except ProcessLookupError:  # the thread ended meanwhile
            pass


@contextmanager
def ray_workers_at_our_niceness() -> Iterator[None]:
    """A Ray started inside starts its worker processes at this process's niceness, unless
    RAY_worker_niceness is set: Ray adds it (15 by default) to the niceness its processes inherit from this one."""
    if RAY_WORKER_NICENESS in os.environ:
        yield
        return
    os.environ[RAY_WORKER_NICENESS] = "0"
    try:
        yield
    finally:
        os.environ.pop(RAY_WORKER_NICENESS, None)


def _threads() -> List[int]:
    """This process's thread ids (Linux), else [0]: the process."""
    try:
        return [int(tid) for tid in os.listdir("/proc/self/task")]
    except FileNotFoundError:
        return [0]
