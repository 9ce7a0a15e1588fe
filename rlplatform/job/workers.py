"""A policy's workers as the job drives them: learner ranks, rollout workers, the weight store,
the gate and the evaluator (`PolicyWorkers`), and `publish`, which streams a new version to them.

The controller builds these; the SFT and RL stages use them.
"""

from __future__ import annotations

import json
import time
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import ray
import redis
from ray.exceptions import RayActorError

from rlplatform.config import EvalConfig, PolicyConfig, RewardSpec
from rlplatform.job.placement import PolicyPlan
from rlplatform.job.supervision import MAX_RESTARTS, WATCH_EVERY_S, RestartDeadline, Revival
from rlplatform.learners.group import LearnerGroup
from rlplatform.tokenization import Prompt
from rlplatform.monitoring.watchdog import HangRule, dump_path, dump_stacks
from rlplatform.transport.deadlines import (EVAL_TIMEOUT_S, WEIGHTS_TIMEOUT_S, JobFailed, WorkerHung, deadline_get,
                                            unresponsive)
from rlplatform.transport.keys import PolicyKeys
from rlplatform.transport.versions import publish_version


class Evaluator:
    """A spare rollout worker that evaluates held-out prompts, scored by the job's rewards, without
    stopping training. Results are the figures of `rlplatform.monitoring.eval_figures`.

    Its actor is started once the learner is set up, so its start-up (torch, the model) runs beside
    the first steps rather than beside the workers the first step waits for; without SFT it evaluates
    the starting weights in the background (`start_baseline`). Ray restarts the actor when its process
    dies; the evaluation it was running starts again once the actor answers. Every restart, during an
    evaluation or between two (seen from the process each answer names), is counted and told to `on_restart`.
    With the watchdog's `hang_rule`, a wait for an evaluation past the rule's deadline (from the longest one so
    far) is a hang: told to `on_hang` with the stacks of the process the actor recorded at `process_key` on the
    Redis at `redis_url` dumped under `run_dir`, the actor is killed for Ray to restart and the evaluation made
    again. An evaluation's clock starts once the actor is constructed: its first start-up (torch, the model, the
    engine) is bounded by the restart deadline instead, as a restart's is."""

    def __init__(self, actor, prompts: List[Prompt], config: EvalConfig, rewards: List[RewardSpec],
                 imports: List[str], *, on_restart: Callable[[str], None], restart: RestartDeadline,
                 while_waiting: Callable[[], None] = lambda: None, hang_rule: Optional[HangRule] = None,
                 on_hang: Callable[[str], None] = lambda message: None, run_dir: str = "", redis_url: str = "",
                 process_key: str = "") -> None:
        self.actor, self.prompts, self.config, self.rewards, self.imports = actor, prompts, config, rewards, imports
        self.on_restart, self.hang_rule, self.on_hang, self.run_dir = on_restart, hang_rule, on_hang, run_dir
        self.restart = restart  # how long the actor may take to be back once it died
        self.while_waiting = while_waiting  # called every WATCH_EVERY_S while the job waits for an evaluation
        self.redis_url, self.process_key = redis_url, process_key
        self.longest_s = 0.0  # the longest wait for an evaluation so far, from the actor's construction on
        self._constructed = actor.__ray_ready__.remote()  # its first call: answered once the actor is built
        self._constructed_at: Optional[float] = None  # when that answer was seen (monotonic)
        self._heard: Set[str] = set()  # the actor processes that have answered
        self._counted_unheard = 0  # restarts counted when a call failed, whose new process has not answered yet
        self._pending: Optional[ray.ObjectRef] = None  # a background evaluation of the newest weights
        self._baseline: Optional[Tuple[ray.ObjectRef, Callable[[Dict], None]]] = None  # (weights, their callback)
        self._baseline_pending: Optional[ray.ObjectRef] = None  # its evaluation, on the actor behind `_pending`
        self._revival: Optional[Revival] = None  # the actor died: it is restarting
        self._lost: Set[ray.ObjectRef] = set()  # calls still held that went to a process already counted dead
        self.last_accuracy: Optional[float] = None  # pass@1 of the newest finished evaluation
        self.restarts = 0

    def _call(self):
        return self.actor.evaluate_latest.remote(self.prompts, self.config, self.rewards, self.imports)

    def _call_on(self, snapshot: ray.ObjectRef):
        return self.actor.evaluate_snapshot.remote(snapshot, self.prompts, self.config, self.rewards, self.imports)

    def _get(self, call: Callable[[], ray.ObjectRef], made: Optional[ray.ObjectRef] = None):
        """The result of `call` (or of `made`, a call already made), made again after each restart. A hang is
        told once per process: while Ray's kill lands (seconds for a process that answers nothing), each further
        deadline only kills it again."""
        if self._revival is not None:  # died during a background evaluation
            self._revival.wait()
            self._revival, made = None, None
        ref = made if made is not None else call()
        started, killed = time.monotonic(), False
        while True:
            try:
                answer = self._wait(ref)
                self.longest_s = max(self.longest_s, time.monotonic() - max(started, self._constructed_at))
                return self._answer(answer)
            except WorkerHung:
                if self.hang_rule is None:
                    raise
                if not killed:
                    self._hung(time.monotonic() - max(started, self._constructed_at or started))
                ray.kill(self.actor, no_restart=False)  # the wait ends as a death does
                killed = True
            except RayActorError:
                killed = False
                if ref in self._lost:  # its process's death is counted: only the call is made again
                    self._lost.discard(ref)
                else:
                    self._restarted()
                    self._revival.wait()
                    self._revival = None
                ref, started = call(), time.monotonic()

    def _wait(self, ref: ray.ObjectRef):
        """`ref`'s answer, `while_waiting` called meanwhile; WorkerHung after `_deadline_s` without one from the
        actor's construction on, or when its construction takes past the restart deadline."""
        begun = time.monotonic()
        while True:
            watched = [ref] if self._constructed_at is not None else [ref, self._constructed]
            ready, _ = ray.wait(watched, num_returns=1, timeout=WATCH_EVERY_S)  # construction seen as it ends
            built = self._built()
            if ref in ready or ray.wait([ref], timeout=0)[0]:
                break
            if not built:
                if time.monotonic() - begun > self.restart.seconds:
                    raise WorkerHung(f"the evaluator was not constructed within {self.restart.seconds:.0f}s (its "
                                     f"restart deadline: monitoring.hang_factor x the workers' start-up)")
            else:
                waited = time.monotonic() - max(begun, self._constructed_at)
                if waited > self._deadline_s():
                    raise WorkerHung(unresponsive("the evaluator", waited, "did not answer"))
            self.while_waiting()
        if self._constructed_at is None:  # answered before the construction's answer was seen: that answer, asked
            ray.wait([self._constructed], timeout=WATCH_EVERY_S)  # first, is on its way (a loaded driver)
            if not self._built():  # or lost with its process: the whole wait counts
                self._constructed_at = begun
        return deadline_get(ref, "the evaluator", self._deadline_s())

    def _built(self) -> bool:
        """Whether the actor's construction has been seen to end (noting when, the first time)."""
        if self._constructed_at is None and ray.wait([self._constructed], timeout=0)[0]:
            self._constructed_at = time.monotonic()
        return self._constructed_at is not None

    def _deadline_s(self) -> float:
        return self.hang_rule.deadline_s(self.longest_s or self.hang_rule.floor_s) if self.hang_rule \
            else EVAL_TIMEOUT_S

    def _hung(self, waited_s: float) -> None:
        """The evaluator answered nothing for `waited_s`, past its deadline: dump its stacks and say so."""
        where = self._recorded_process()
        dumped = dump_stacks(where["pid"], where.get("node_id", ""),
                             dump_path(self.run_dir, "evaluator", where["pid"])) if where else \
            "no stack dump (its process is not recorded on Redis)"
        pid = f" (pid {where['pid']} on {where['node_ip']})" if where else ""
        rule = self.hang_rule
        if self._constructed_at is None:
            what = (f"was not constructed within {waited_s:.0f}s (deadline {self.restart.seconds:.0f}s: its restart "
                    f"deadline, {rule.factor:g}x the workers' start-up, at least {rule.floor_s:g}s)")
        else:
            basis = f"the longest evaluation so far, {self.longest_s:.1f}s, at least {rule.floor_s:g}s" \
                if self.longest_s else "monitoring.hang_floor_s, no evaluation waited for yet"
            what = f"answered nothing for {waited_s:.0f}s (deadline {self._deadline_s():.0f}s: {rule.factor:g}x {basis})"
        self.on_hang(f"the evaluator{pid} {what}; {dumped}; restarting it, the evaluation made again")

    def _recorded_process(self) -> Optional[Dict]:
        """`this_process()` of the actor's newest process, as it recorded it on starting (None: not readable)."""
        try:
            with redis.Redis.from_url(self.redis_url, socket_timeout=5) as client:
                recorded = client.get(self.process_key)
        except (redis.RedisError, ValueError):
            return None
        return json.loads(recorded) if recorded else None

    def run_now(self) -> Tuple[int, Dict]:
        """(version, figures) of the newest published weights, evaluated now."""
        return self._newest_done(self._get(self._call))

    def _newest_done(self, result: Tuple[int, Dict]) -> Tuple[int, Dict]:
        """`result`, (version, figures) of the newest weights, recorded as the latest accuracy."""
        self.last_accuracy = result[1]["accuracy"]
        return result

    def score(self, snapshot: ray.ObjectRef) -> float:
        """Held-out pass@1 of weights not published as a version (an SFT stage in progress)."""
        return self._get(lambda: self._call_on(snapshot))["accuracy"]

    def start_baseline(self, snapshot: ray.ObjectRef, done: Callable[[Dict], None]) -> None:
        """Evaluate `snapshot`, the weights RL starts from, in the background: behind the first evaluation
        `start` begins (at once when `eval.every_steps` is 0), so the in-run curve is not held up. `poll`
        hands its figures to `done`, or `finish_baseline` waits for them."""
        self._baseline = (snapshot, done)

    def finish_baseline(self) -> None:
        """Wait for the baseline's figures (none when none was started, or they are in)."""
        if self._baseline is None:
            return
        snapshot = self._baseline[0]
        self._baseline_done(self._get(lambda: self._call_on(snapshot), self._baseline_pending))

    def _baseline_done(self, figures: Dict) -> None:
        done = self._baseline[1]
        self._baseline, self._baseline_pending = None, None
        done(figures)

    def start(self) -> None:
        """Begin evaluating the newest weights in the background, unless one is under way."""
        if self._pending is None and self._revival is None:
            self._pending = self._call()
            self._start_baseline_call()

    def _start_baseline_call(self) -> None:
        if self._baseline is not None and self._baseline_pending is None:
            self._baseline_pending = self._call_on(self._baseline[0])

    def finish_pending(self) -> Optional[Tuple[int, Dict]]:
        """(version, figures) of the background evaluation of the newest weights under way, waited for;
        None when none is."""
        if self._pending is None:
            return None
        pending, self._pending = self._pending, None
        return self._newest_done(self._get(self._call, pending))

    def poll(self) -> Optional[Tuple[int, Dict]]:
        """(version, figures) of a finished background evaluation of the newest weights, else None. The
        baseline's figures go to its callback."""
        self._built()
        if self._revival is not None:
            if not self._revival.ready():
                return None
            self._revival = None
        if not self.config.every_steps:
            self._start_baseline_call()
        try:
            if self._baseline_pending is not None and ray.wait([self._baseline_pending], timeout=0)[0]:
                self._baseline_done(self._answer(ray.get(self._baseline_pending)))
            if self._pending is None or not ray.wait([self._pending], timeout=0)[0]:
                return None
            result = self._answer(ray.get(self._pending))
        except RayActorError:  # both calls are lost; the baseline's is made again with the next `start`
            self._restarted()
            self._pending = self._baseline_pending = None
            return None
        self._pending = None
        return self._newest_done(result)

    def _answer(self, answer: Tuple[Tuple[str, bool], Any]) -> Any:
        """An evaluator call's result. A process not heard from before that Ray started as a restart is a restart:
        counted here, unless a failed call counted it already."""
        (process, restarted), result = answer
        if process not in self._heard:
            self._heard.add(process)
            if restarted and self._counted_unheard:
                self._counted_unheard -= 1
            elif restarted:
                self._count_restart("the evaluator was restarted between two evaluations")
        return result

    def _restarted(self) -> None:
        """A call failed because the actor's process died: counted, and waited for while Ray restarts it."""
        self._count_restart("the evaluator died during an evaluation; it is evaluating again once Ray restarted it")
        self._counted_unheard += 1
        self._lost.update(ref for ref in (self._pending, self._baseline_pending) if ref is not None)
        self._revival = Revival(self.actor, "the evaluator", self.restart.seconds)

    def _count_restart(self, text: str) -> None:
        self.restarts += 1
        self.on_restart(text)
        if self.restarts > MAX_RESTARTS:
            raise JobFailed(f"the evaluator died {self.restarts} times; see the Ray logs") from None


@dataclass
class PolicyWorkers:
    """One policy's actors and handles: learner ranks, rollout workers, weight store, evaluator, and a distilling
    policy's teacher scoring workers."""
    plan: PolicyPlan  # the policy's config as planned for the cluster, and its weight transport
    learner: LearnerGroup
    rollout: List  # RolloutActor handles
    weight_store: object  # WeightStore handle
    evaluator: Optional[Evaluator]  # None with `eval.enabled: false`
    _: KW_ONLY
    keys: PolicyKeys
    sft_rows: List[Dict]  # the training rows whose prompts fit `data.max_prompt_tokens`
    data: Dict[str, int]  # rows kept and skipped as too long, for the summary
    teachers: List = field(default_factory=list)  # a distilling policy's teacher scoring workers (TeacherActor handles)
    add_rollout: Optional[Callable[..., Any]] = None  # starts rollout actor `index=` (`node_id=`), not restarted (`elastic`)

    @property
    def config(self) -> PolicyConfig:
        """The policy's config with its `auto` settings resolved (`PolicyPlan.policy`)."""
        return self.plan.policy

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def generating(self) -> List:
        """The actors that load each published version: the rollout workers and the evaluator."""
        return self.rollout + ([self.evaluator.actor] if self.evaluator else [])

    @property
    def evaluator_restarts(self) -> int:
        return self.evaluator.restarts if self.evaluator else 0


def publish(workers: PolicyWorkers, client, version: int, snapshot=None, *,
            deadline_s: float = WEIGHTS_TIMEOUT_S) -> float:
    """Stream the policy's weights as `version`: `snapshot` when the learner step streamed them (an
    object ref for the weight store, or the version already broadcast), else the learner's current
    weights. The version goes to Redis last. Returns the seconds it took; a weight store that has not taken
    the version within `deadline_s` is named (`WorkerHung`)."""
    start = time.perf_counter()
    sent = snapshot if snapshot is not None else workers.learner.stream_weights(version)
    if isinstance(sent, ray.ObjectRef):
        deadline_get(workers.weight_store.publish.remote(version, [sent]),
                     f"the weight store of policy '{workers.name}'", deadline_s)
    publish_version(client, workers.keys, version)
    return time.perf_counter() - start
