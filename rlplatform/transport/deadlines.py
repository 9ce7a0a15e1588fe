"""Deadlines on other processes: remote waits, worker heartbeats, and the failures a job cannot go on from.

`deadline_get` is `ray.get` with a deadline and a message naming what did not answer; a learner
rank's death becomes `LearnerDied`. Rollout and reward workers (in the job or standalone) beat on
the job's heartbeat hash each time their loop goes round (`Heartbeats`): a `Beat` says where the worker
runs, what it is doing and the longest it went between beats, for the watchdog
(`rlplatform.monitoring.watchdog`) and `rlp status`. `SilentWorkers` names
those silent past `monitoring.worker_silent_s`; `ScoringStall` names a reward queue where samples wait
and none was scored for `monitoring.scoring_stall_s` (a stopped or wedged reward worker, sooner than
its silence is named). All say what stopped answering in one wording.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import KW_ONLY, asdict, dataclass
from typing import Dict, List, Optional

import ray
import redis
from ray.exceptions import GetTimeoutError, RayActorError

from rlplatform.transport.keys import JobKeys

LEARNER_TIMEOUT_S = 3600.0  # one learner call (a step, a checkpoint) on the largest models
WEIGHTS_TIMEOUT_S = 600.0  # publishing one weight snapshot
EVAL_TIMEOUT_S = 3600.0  # one held-out evaluation
BEAT_EVERY_S = 1.0  # a worker's loop writes its heartbeat at most this often
REWARD_WORKER = "reward worker "  # how reward workers' labels on the heartbeat hash begin


class JobFailed(RuntimeError):
    """The job cannot go on; the one-line message says why and how to resume. `exit_code`: `rlp run`'s."""
    exit_code = 1


class LearnerDied(JobFailed):
    """A learner rank's process died: its state is gone and the job must resume from a checkpoint."""


class WorkerHung(JobFailed):
    """A remote call passed its deadline; the message names the worker."""


class LearnerHung(WorkerHung):
    """A learner step made no progress past the watchdog's deadline: the job ends, to be resumed from its
    checkpoint, with its own exit code."""
    exit_code = 3


def unresponsive(what: str, seconds: float, how: str = "made no progress") -> str:
    """The one wording for a worker that stopped answering."""
    return f"{what} {how} for {seconds:.0f}s; it hangs or its node is lost"


def deadline_get(refs, what: str, timeout_s: float):
    """`ray.get(refs)`, failing after `timeout_s` with a message naming `what` did not answer."""
    try:
        return ray.get(refs, timeout=timeout_s)
    except RayActorError as err:
        if getattr(err, "actor_id", None) and "LearnerRank" in str(err):
            raise LearnerDied(f"a learner rank died ({what}: {type(err).__name__})") from None
        raise
    except GetTimeoutError:
        raise WorkerHung(unresponsive(what, timeout_s, "did not answer") +
                         " (see the Ray logs under /tmp/ray/session_latest/logs)") from None


@dataclass(frozen=True)
class Beat:
    """A worker's last beat: when, which process where, what it went on to do, and the longest it went between
    two beats so far (or the longest a round may take by design, a reward call's timeout, if longer)."""
    worker: str
    at: float
    pid: int = 0
    node_ip: str = ""
    node_id: str = ""  # Ray's node id ("" outside Ray)
    _: KW_ONLY
    actor: str = ""  # its Ray actor id ("" for a worker that is not an actor, a standalone one)
    action: str = ""
    version: Optional[int] = None  # the policy version it holds (rollout workers)
    longest_round_s: float = 0.0

    def describe(self) -> str:
        doing = f", {self.action}" if self.action else ""
        version = f" at version {self.version}" if self.version is not None else ""
        return f"{self.worker} (pid {self.pid} on {self.node_ip}{doing}{version})"


def this_process() -> Dict[str, object]:
    """Where a beat comes from: pid, node, and the Ray node and actor ids where it runs in Ray."""
    if not ray.is_initialized():
        return {"pid": os.getpid(), "node_ip": socket.gethostname()}
    context = ray.get_runtime_context()
    return {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(), "node_id": context.get_node_id(),
            "actor": context.get_actor_id() or ""}


def rollout_worker_label(index: int, policy: str) -> str:
    """How a rollout worker beats and is named in alerts, as silent workers are."""
    return f"rollout worker {index} of policy '{policy}'"


class Heartbeats:
    """The job's heartbeat hash on Redis: worker label (`rollout worker 0 of policy 'p'`,
    `reward worker <name>`) -> its last `Beat`, as JSON."""

    def __init__(self, client: redis.Redis, run: str) -> None:
        self.client, self.key = client, JobKeys(run).heartbeats
        self._last: Dict[str, float] = {}
        self._action: Dict[str, str] = {}
        self._beat_at: Dict[str, float] = {}
        self._longest: Dict[str, float] = {}
        self._process: Optional[Dict[str, object]] = None

    def beat(self, worker: str, action: str = "", version: Optional[int] = None, round_limit_s: float = 0.0) -> None:
        """`worker` made progress and goes on to `action`; written at most every `BEAT_EVERY_S`, and at once when
        the action changes. `round_limit_s`: the longest a round may take by design."""
        now = time.time()
        if worker in self._beat_at:
            self._longest[worker] = max(self._longest.get(worker, 0.0), now - self._beat_at[worker])
        self._beat_at[worker] = now
        if now - self._last.get(worker, 0.0) < BEAT_EVERY_S and action == self._action.get(worker):
            return
        self._last[worker], self._action[worker] = now, action
        self._process = self._process or this_process()
        longest = max(self._longest.get(worker, 0.0), round_limit_s)
        beat = Beat(worker, now, action=action, version=version, longest_round_s=round(longest, 3), **self._process)
        self.client.hset(self.key, worker, json.dumps({k: v for k, v in asdict(beat).items() if k != "worker"}))

    def leave(self, worker: str) -> None:
        """`worker` stopped on purpose, or left the job (an elastic worker whose node went away): it is no longer
        watched."""
        self.client.hdel(self.key, worker)

    def await_outside_workers(self, within_s: Optional[float] = None, poll_s: float = 0.05) -> None:
        """Once the job's stop flag is set: wait until every worker outside Ray (a standalone `rlp reward-worker`
        or `rlp tool-worker`) has left, each at most twice its longest round after its last beat, the longest it
        can take to finish the round it is in and see the flag (one gone without leaving is waited for no longer),
        and all of them at most `within_s` (a stop on a signal does not wait out a reward call's timeout)."""
        cap = time.time() + within_s if within_s is not None else float("inf")
        expected = {beat.worker: min(beat.at + 2 * max(beat.longest_round_s, BEAT_EVERY_S), cap)
                    for beat in self.beats() if not beat.actor}
        while expected:
            present, now = {name.decode() for name in self.client.hkeys(self.key)}, time.time()
            expected = {worker: until for worker, until in expected.items() if worker in present and now < until}
            if expected:
                time.sleep(poll_s)

    def beats(self) -> List[Beat]:
        """Each watched worker's last beat."""
        return [Beat(k.decode(), **json.loads(v)) for k, v in self.client.hgetall(self.key).items()]

    def ages(self) -> Dict[str, float]:
        """Seconds since each watched worker last beat."""
        now = time.time()
        return {beat.worker: now - beat.at for beat in self.beats()}

    def silent(self, after_s: float) -> Dict[str, float]:
        """Seconds since each worker silent for more than `after_s` last beat."""
        return {worker: age for worker, age in self.ages().items() if age > after_s}


class SilentWorkers:
    """Names each worker once when it goes silent, and again if it recovers and goes silent anew."""

    def __init__(self, heartbeats: Heartbeats, after_s: float) -> None:
        self.heartbeats, self.after_s = heartbeats, after_s
        self.now_silent: Dict[str, float] = {}

    def newly_silent(self) -> List[str]:
        """One message per worker that went silent since the last call."""
        before, self.now_silent = self.now_silent, self.heartbeats.silent(self.after_s)
        return [unresponsive(worker, age) for worker, age in sorted(self.now_silent.items()) if worker not in before]

    def listing(self) -> str:
        """The silent workers as `rlp status` shows them ('' when none)."""
        return ", ".join(f"{worker} ({age:.0f}s)" for worker, age in sorted(self.now_silent.items()))


class ScoringStall:
    """Names the reward queue once when samples wait in it and none was scored for `after_s`, and again after
    scoring resumed and stalls anew; the message gives each reward worker's last beat and the calls' timeouts
    (`timeouts`: reward label -> timeout_s), since a slow reward stalls the queue as a hung worker does."""

    def __init__(self, heartbeats: Heartbeats, after_s: float, timeouts: Dict[str, float]) -> None:
        self.heartbeats, self.after_s, self.timeouts = heartbeats, after_s, timeouts
        self.stalled = False

    def check(self, waiting: int, since_scored_s: float) -> Optional[str]:
        """A message when the queue has just stalled: `waiting` samples unscored, the last scored `since_scored_s` ago."""
        was, self.stalled = self.stalled, waiting > 0 and since_scored_s >= self.after_s
        if not self.stalled or was:
            return None
        beats = ", ".join(f"{worker} {age:.0f}s ago" for worker, age in sorted(self.heartbeats.ages().items())
                          if worker.startswith(REWARD_WORKER))
        timeouts = ", ".join(f"{label} {seconds:g}s" for label, seconds in self.timeouts.items())
        return (f"the reward queue ({waiting} samples waiting) scored nothing for {since_scored_s:.0f}s; reward "
                f"workers last went round: {beats or 'none has started'}; a reward call runs up to its timeout "
                f"({timeouts}) before it counts as an error, else a worker hangs or its node is lost")
