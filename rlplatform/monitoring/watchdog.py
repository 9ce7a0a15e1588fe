"""The watchdog: no component of a running job stalls it silently.

Rollout and reward workers beat on the job's heartbeat hash as their loops go round (`Beat`: pid, node,
action, version, the longest round so far); the controller times each learner step. A component that makes
no progress for `monitoring.hang_factor` times its longest round or step measured so far (at least
`monitoring.hang_floor_s`) is hung. The watchdog then
- names it in a `hang` alert: the component, its pid and node, what it was doing and for how long;
- writes every thread's Python stack of its process to `<run>/hangs/` (`py-spy dump --nonblocking`, which
  reads a stopped process too, on the process's own node);
- recovers: a worker's actor is killed, Ray restarts it and the supervisor runs its loop again, re-issuing its
  unfinished work; its deadline doubles, so that a slow worker is not killed over and over. A learner that
  hangs ends the job (`LearnerHung`, exit code 3) naming the dump and the checkpoint to resume from.
A job whose embedded Redis stopped answering ends naming it, with that server's process state (`dump_process_state`:
not Python, so its kernel state, wait channel and stack) in `<run>/hangs/`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, TypeVar

import ray

from rlplatform.transport.deadlines import LEARNER_TIMEOUT_S, Beat, LearnerHung, WorkerHung

DUMP_TIMEOUT_S = 30.0  # one py-spy dump

T = TypeVar("T")


@dataclass(frozen=True)
class HangRule:
    """When a component is hung: no progress for `factor` times its longest measured round (at least `floor_s`)."""
    factor: float
    floor_s: float

    def deadline_s(self, longest_s: float) -> float:
        return max(self.floor_s, self.factor * longest_s)


def hang_rule(monitoring) -> Optional[HangRule]:
    """The job's `HangRule` (`monitoring.hang_factor`, `monitoring.hang_floor_s`); None with the watchdog off."""
    return deadline_rule(monitoring) if monitoring.watchdog else None


def deadline_rule(monitoring) -> HangRule:
    """The rule on `monitoring.hang_factor` and `monitoring.hang_floor_s`, whether or not the watchdog acts on hangs:
    the deadlines of a restart, of a group's completion and of an agent's next request follow it too."""
    return HangRule(monitoring.hang_factor, monitoring.hang_floor_s)


def dump_stacks(pid: int, node_id: str, path: str) -> str:
    """Every thread's Python stack of process `pid` on Ray node `node_id`, written to `path`; returns what to
    tell the user (the path, or why there is no dump)."""
    try:
        if not node_id or node_id == ray.get_runtime_context().get_node_id():
            text = _py_spy_dump(pid)
        else:  # read by a task on the process's node
            strategy = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id, soft=False)
            text = ray.get(_dump_on_node.options(scheduling_strategy=strategy).remote(pid), timeout=DUMP_TIMEOUT_S)
    except Exception as err:  # the dump is a courtesy: the alert and the recovery go on without it
        return f"no stack dump ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return f"stacks in {path}"


def _py_spy_dump(pid: int) -> str:
    py_spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(py_spy):
        raise FileNotFoundError("py-spy is not installed")
    done = subprocess.run([py_spy, "dump", "--nonblocking", "--pid", str(pid)], capture_output=True, text=True,
                          timeout=DUMP_TIMEOUT_S)
    if done.returncode:
        raise RuntimeError(f"py-spy: {(done.stderr or done.stdout).strip()[:300]}")
    return done.stdout


@ray.remote(num_cpus=0)
def _dump_on_node(pid: int) -> str:
    return _py_spy_dump(pid)


def dump_process_state(pid: int, path: str) -> str:
    """What the kernel says of local process `pid` (its status, wait channel and kernel stack, where readable),
    written to `path`: the stack dump of a process that runs no Python (the embedded redis-server). Returns what
    to tell the user."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read().rstrip()
    except OSError:
        return f"no process state (pid {pid} is gone)"
    parts = [f"== /proc/{pid}/status\n{status}"]
    for name in ("wchan", "stack"):
        try:
            with open(f"/proc/{pid}/{name}") as f:
                parts.append(f"== /proc/{pid}/{name}\n{f.read().rstrip()}")
        except OSError as err:  # not ours to read
            parts.append(f"== /proc/{pid}/{name}: not readable ({err.strerror})")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(parts) + "\n")
    state = next((line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("State:")), "?")
    return f"its process (pid {pid}) was {state}: state in {path}"


def dump_path(run_dir: str, component: str, pid: int) -> str:
    """`<run>/hangs/<component>-pid<pid>-<time>.txt`, the component's label made a file name."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", component).strip("-")
    return os.path.join(run_dir, "hangs", f"{name}-pid{pid}-{time.strftime('%Y%m%d-%H%M%S')}.txt")


class WorkerWatchdog:
    """Hung rollout and reward workers, from their beats: dumped, restarted (`restart(actor_id)` kills the
    actor, for Ray and the supervisor to bring back; False where the job holds no such actor) and alerted."""

    def __init__(self, rule: HangRule, run_dir: str, restart: Callable[[str], bool]) -> None:
        self.rule, self.run_dir, self.restart = rule, run_dir, restart
        self.hangs: Dict[str, int] = {}  # worker label -> hangs recovered so far
        self._handled: Dict[str, float] = {}  # worker label -> the beat time of the hang already handled

    def deadline_s(self, beat: Beat) -> float:
        return self.rule.deadline_s(beat.longest_round_s) * 2 ** self.hangs.get(beat.worker, 0)

    def check(self, beats: Iterable[Beat], now: Optional[float] = None) -> List[str]:
        """Handle each worker hung since its last beat; returns the alerts to raise, one per hang."""
        now, raised = now or time.time(), []
        for beat in beats:
            silent_s, deadline = now - beat.at, self.deadline_s(beat)
            if silent_s <= deadline or self._handled.get(beat.worker) == beat.at:
                continue
            self._handled[beat.worker] = beat.at
            dumped = dump_stacks(beat.pid, beat.node_id, dump_path(self.run_dir, beat.worker, beat.pid))
            restarted = bool(beat.actor) and self.restart(beat.actor)
            if restarted:
                self.hangs[beat.worker] = self.hangs.get(beat.worker, 0) + 1
            what = "restarting it, its unfinished work issued again" if restarted else \
                "it is not one of this job's actors, so it is left as it is"
            message = (f"{beat.describe()} made no progress for {silent_s:.0f}s (deadline {deadline:.0f}s: "
                       f"{self.rule.factor:g}x its longest round, {beat.longest_round_s:.1f}s, at least "
                       f"{self.rule.floor_s:g}s); {dumped}; {what}")
            raised.append(message)
        return raised


@dataclass(frozen=True)
class LearnerProcess:
    """Where a learner rank runs, for its hang alert and stack dump."""
    label: str  # "learner rank 0 of policy 'p'"
    pid: int
    node_ip: str
    node_id: str


def rank_processes(policy: str, processes: List[Dict]) -> List[LearnerProcess]:
    """A policy's learner ranks from their `this_process()` records (`LearnerGroup.processes`)."""
    return [LearnerProcess(f"learner rank {i} of policy '{policy}'", p["pid"], p["node_ip"], p.get("node_id", ""))
            for i, p in enumerate(processes)]


def learner_hang(rule: HangRule, run_dir: str, ranks: List[LearnerProcess], running_s: float, doing: str,
                 *, longest_s: float, checkpoint: Optional[str]) -> Optional[LearnerHung]:
    """The error that ends the job when the learner has been `doing` a call for `running_s`, past its deadline
    from `longest_s` (None while it has not): every rank's stacks dumped, the one line naming them and the
    checkpoint to resume from."""
    deadline = rule.deadline_s(longest_s)
    if running_s < deadline:
        return None
    dumps = [dump_stacks(rank.pid, rank.node_id, dump_path(run_dir, rank.label, rank.pid)) for rank in ranks]
    where = ", ".join(f"{rank.label} (pid {rank.pid} on {rank.node_ip})" for rank in ranks)
    resume = f"resume with `rlp run --resume {run_dir}` (checkpoint {checkpoint})" if checkpoint else \
        "no checkpoint was written before it"
    return LearnerHung(f"the learner hung: {doing} made no progress for {running_s:.0f}s (deadline {deadline:.0f}s: "
                       f"{rule.factor:g}x the longest so far, {longest_s:.1f}s, at least {rule.floor_s:g}s) on "
                       f"{where}; {'; '.join(dumps)}; {resume}")


def watched_call(rule: Optional[HangRule], run_dir: str, ranks: Callable[[], List[LearnerProcess]], doing: str,
                 longest_s: float, *, checkpoint: Optional[str], call: Callable[[float], T]) -> T:
    """`call(deadline_s)`, a learner call the job waits on (`doing`: an SFT step, a write of its weights). With the
    watchdog's `rule` its deadline comes from the longest such call so far, `longest_s` (before one, from the
    floor), and one past it is the learner's hang (`learner_hang`, naming `ranks()` and `checkpoint`); without, the
    learner's own limit."""
    deadline = rule.deadline_s(longest_s or rule.floor_s) if rule else LEARNER_TIMEOUT_S
    started = time.perf_counter()
    try:
        return call(deadline)
    except WorkerHung:
        if rule is None:
            raise
        raise learner_hang(rule, run_dir, ranks(), max(time.perf_counter() - started, deadline), doing,
                           longest_s=longest_s or rule.floor_s, checkpoint=checkpoint) from None
