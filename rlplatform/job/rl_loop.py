"""The asynchronous RL stage: scored groups -> advantages -> learner step -> publish weights.

Rollout and reward workers run their own loops the whole time; this loop only reads the
metadata of scored samples (ids, version, reward, token counts) from the shared reward queue,
routes it to its policy, hands each policy's learner fresh-enough batches as sample ids with
their advantages (the learner ranks fetch the samples from Redis; several policies' steps run at
once) and streams each new version back. Samples too stale for the bound are dropped and counted;
trained and dropped samples are deleted from Redis.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter, deque
from dataclasses import KW_ONLY, dataclass, field, fields, replace
from functools import partial
from typing import Callable, Deque, Dict, List, Mapping, Optional, Sequence

import ray

from rlplatform.config import JobConfig
from rlplatform.job.checkpoint import (CheckpointState, DiskFull, PolicyState, latest_checkpoint, learner_dir,
                                       write_checkpoint)
from rlplatform.job.elastic import AttachDesk, ElasticRollout
from rlplatform.job.signals import StopSignals
from rlplatform.job.summaries import RLFigures, RLSummary, plain_text
from rlplatform.job.supervision import RestartDeadline, Supervisor
from rlplatform.job.workers import PolicyWorkers, publish
from rlplatform.learners.algorithms import ADVANTAGE_ESTIMATORS, grpo_advantages
from rlplatform.learners.group import TrainItem
from rlplatform.learners.step_result import LearnerTotals
from rlplatform.monitoring.error_guard import RewardErrorGuard, Verdict
from rlplatform.monitoring.metrics import Metrics
from rlplatform.monitoring.rl_monitor import RLMonitor
from rlplatform.monitoring.teacher_guard import TeacherGuard
from rlplatform.monitoring.expiry_alerts import agents_gone, expired_groups
from rlplatform.monitoring.watchdog import (HangRule, LearnerProcess, WorkerWatchdog, deadline_rule, hang_rule,
                                            learner_hang, rank_processes, watched_call)
from rlplatform.rewards.shaping import overlong_penalty
from rlplatform.scheduling.buffer import Batch, GroupBuffer, has_signal
from rlplatform.scheduling.group_deadline import GroupDeadline
from rlplatform.scheduling.groups import GroupSchedule
from rlplatform.scheduling.ledger_mirror import LedgerMirror
from rlplatform.scheduling.staleness import StalenessRule
from rlplatform.transport.deadlines import (LEARNER_TIMEOUT_S, WEIGHTS_TIMEOUT_S, Beat, Heartbeats, JobFailed,
                                            LearnerDied, LearnerHung, ScoringStall, SilentWorkers, WorkerHung)
from rlplatform.transport.redis_server import RedisUnavailable
from rlplatform.transport.keys import PolicyKeys
from rlplatform.transport.reward_queue import RewardQueue
from rlplatform.transport.rollout_counters import RolloutCounters
from rlplatform.transport.samples import ResultMeta
from rlplatform.transport.worker_attach import AttachRequests


_LEARNER_TOTALS = {"learner_compute_s": "compute_s", "learner_model_tokens": "model_tokens",
                   "learner_mfu_s": "mfu_s"}  # RLCounters.state's key -> LearnerTotals field


@dataclass
class RLCounters:
    samples_scored: int = 0
    samples_trained: int = 0
    samples_dropped_stale: int = 0
    samples_dropped_error: int = 0
    samples_dropped_zero_advantage: int = 0
    _: KW_ONLY
    groups_in_batches: int = 0  # groups the learner was given
    groups_with_signal: int = 0  # of those, groups whose rewards were not all equal
    samples_dropped_expired: int = 0  # samples of groups that did not complete within their deadline (GroupDeadline)
    groups_expired: int = 0
    samples_dropped_invalid: int = 0  # reward error or drop flag, in a group trained without them
    reward_errors: int = 0
    reward_timeouts: int = 0
    samples_filtered: int = 0
    reward_reasons: Counter = field(default_factory=Counter)  # "<reward>/<reason>" -> samples (rewards that say why)
    staleness_trained: Counter = field(default_factory=Counter)  # version gap -> samples
    learner_busy_s: float = 0.0
    steps_queued: int = 0  # learner steps sent while another was running: queued on the learner, started as it ended
    weight_publish_s: float = 0.0
    samples_generated_before: int = 0  # by earlier attempts, up to the checkpoint this attempt resumed from
    samples_abandoned: int = 0  # generated but neither trained nor dropped at a checkpoint resumed from
    learner: LearnerTotals = field(default_factory=LearnerTotals)  # the learner steps' compute, tokens and MFU

    def state(self) -> Dict:
        """The counters as JSON values: each Counter a plain dict with string keys (`asdict` would rebuild a
        Counter from its (key, count) pairs, counting the pairs themselves), the learner totals as
        `learner_compute_s`, `learner_model_tokens` and `learner_mfu_s`."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "learner"}
        return {**values, "staleness_trained": {str(k): v for k, v in self.staleness_trained.items()},
                "reward_reasons": dict(self.reward_reasons),
                **{key: getattr(self.learner, name) for key, name in _LEARNER_TOTALS.items()}}

    @classmethod
    def from_state(cls, state: Dict) -> "RLCounters":
        """Counters from `state` (a state without some counters, written before they existed, has them at 0)."""
        gaps = Counter({int(k): v for k, v in state["staleness_trained"].items()})
        counts = {k: v for k, v in state.items() if k not in _LEARNER_TOTALS}
        learner = LearnerTotals(**{name: state.get(key, 0.0) for key, name in _LEARNER_TOTALS.items()})
        return cls(**{**counts, "staleness_trained": gaps, "reward_reasons": Counter(state.get("reward_reasons", {})),
                      "learner": learner})


@dataclass(frozen=True)
class StageEnd:
    """The figures every policy's summary shares at the stage's end."""
    restarts: Mapping[str, int]  # the supervisor's restarts of rollout and reward workers, by kind
    checkpoint: Optional[str]  # the newest checkpoint
    results_held: int  # results stored and neither trained nor dropped, all policies'
    controller_cpu_s: float  # the controller's CPU time in the stage, all policies'
    wandb_dir: Optional[str]


TURN_WAIT_MS = 20  # the RL loop's longest wait for results or a learner step's end before going round
STEP_RESULT_WAIT_S = 0.05  # a learner step announced as ended: its result is awaited this long at most, then next turn
STOP_GRACE_S = 5.0  # after a signal: workers still inside a call then are stopped with it (their samples unscored)
STEPS_IN_FLIGHT = 2  # learner steps sent at most: the one running and the next, queued on the learner so it starts
# the moment the first ends (a step's batch must still meet the staleness bound at the version it trains)


@dataclass
class StepInFlight:
    refs: List[ray.ObjectRef]  # each learner rank's result
    batch: Batch
    version: int  # the weights' version the step starts from (its samples' staleness is measured against it)
    sent: float  # perf_counter time it was sent


@dataclass(frozen=True)
class RedisMirror:
    """What a checkpoint and the stage's summary read from the job's Redis, as last read (at the stage's start and
    after each learner step), with the groups trained since closed in its ledger: a job whose Redis went away
    checkpoints and reports from it."""
    ledger: LedgerMirror
    rollout: RolloutCounters  # the policy's rollout workers' counters
    reward: Dict[str, float]  # the reward workers' counters


class StageFailed(JobFailed):
    """The RL stage ended on an error: `summaries` are its policies' figures as they stood (`PolicyRun.summary`);
    `redis_lost`: the error was the job's Redis going away."""

    def __init__(self, message: str, summaries: Dict[str, RLSummary], exit_code: int = 1,
                 redis_lost: bool = False) -> None:
        super().__init__(message)
        self.summaries, self.exit_code, self.redis_lost = summaries, exit_code, redis_lost


class PolicyRun:
    """One policy's RL stage: its buffer, counters and monitor, and the learner steps in flight."""

    def __init__(self, job: JobConfig, workers: PolicyWorkers, queue: RewardQueue, metrics: Metrics,
                 train_rows: List[Dict]) -> None:
        self.job, self.workers, self.queue, self.rl = job, workers, queue, workers.config.rl
        self.train_rows, self.metrics = train_rows, metrics
        self.counters, self.buffer = RLCounters(), GroupBuffer(self.rl.group_size)
        self.rule = StalenessRule.of(self.rl)
        self.schedule = GroupSchedule(queue.client, queue.keys.run, workers.name, self.rule)
        self.monitor = RLMonitor(job, self.rl, metrics, queue, workers.name, keys=workers.keys,
                                 rollout_workers=len(workers.rollout))
        self.monitor.last_accuracy = workers.evaluator.last_accuracy if workers.evaluator else None
        self.version, self.start = 0, time.perf_counter()
        self.hold = False  # no new learner step starts while set (a checkpoint or a stop is under way)
        self.error_guard = RewardErrorGuard(job.monitoring, self.rl.batch_prompts * self.rl.group_size,
                                            time.monotonic())
        self.failure: Optional[str] = None  # why the job must stop (the reward error guard's verdict)
        self._signal_drops = 0  # zero-advantage groups dynamic sampling dropped since the last batch
        self._last_scored = time.monotonic()  # when a scored sample last arrived (the stage's start before one)
        self.first_step_at: Optional[float] = None  # wall-clock time the first learner step ended
        self._reward_counters_at_start = queue.counters(queue.keys.reward_stats)
        self._steps: Deque[StepInFlight] = deque()  # learner steps sent and not yet finished, oldest first
        self._last_step_end = 0.0  # perf_counter time the newest finished step was seen to end
        self.longest_step_s = 0.0  # the longest a learner step has run (queued ones from when the one before ended)
        self.longest_save_s = 0.0  # the longest the learner took to write its part of a checkpoint
        self.longest_publish_s = 0.0  # the longest a version's weights took to reach the weight store
        self._unrecorded: Optional[Batch] = None  # a step counted as trained whose record has not been written
        self.hang_rule = hang_rule(job.monitoring)
        self.deadline_rule = rule = deadline_rule(job.monitoring)
        self.group_deadline = GroupDeadline(self.rl.group_timeout_s, rule.deadline_s, rule.floor_s)
        self.mirror: Optional[RedisMirror] = None
        self.trained_at_start = 0  # samples trained before this attempt (a resumed job's)
        self._last_watch = time.monotonic()
        self.trained_log = os.path.join(job.policy_dir(workers.name), "trained.jsonl")
        self.elastic: Optional[ElasticRollout] = None  # rollout workers added or attached while the stage runs
        self.teacher = job.teacher_of(workers.config)  # on-policy distillation's teacher policy, or None
        self.teacher_keys = PolicyKeys(queue.keys.run, self.teacher.name) if self.teacher else None
        self.teacher_guard: Optional[TeacherGuard] = None  # set where the teacher trains RL in this job too
        distill = workers.config.distill
        workers.learner.start_stage(self.rl.lr, keep_reference=self.rl.kl_coef > 0 or self.rl.track_reference_kl,
                                    distill_coef=distill.coef if self.teacher else 0.0)

    def restore(self, state: PolicyState, checkpoint: str, attempt: int) -> None:
        """Continue from a checkpoint: learner, counters, ledger (in-flight prompts re-issued), gate, weights."""
        self.workers.learner.load_checkpoint(learner_dir(checkpoint, self.workers.name))
        self.version = state.version
        self.counters = RLCounters.from_state(state.counters)
        # the samples in flight at the checkpoint are lost with the attempt: their prompts are issued again
        self.counters.samples_abandoned += self.counters.samples_generated_before - _accounted(self.counters)
        self.trained_at_start = self.counters.samples_trained
        self.monitor.samples_seen = self.counters.samples_trained
        self.monitor.eval_history = state.eval_history
        self.monitor.restore_rewards(state.rewards)
        self.schedule.resume(state.ledger, attempt, self.version)
        _keep_lines(self.trained_log, self.version)
        publish(self.workers, self.queue.client, self.version)

    def state(self, offline: bool = False) -> PolicyState:
        """What a checkpoint keeps of this policy's stage (taken with no learner step in flight); its counters
        count the samples generated so far over every attempt. `offline`: the job's Redis went away, Redis's part
        comes from the mirror."""
        generated = self.counters.samples_generated_before + int(self._rollout_counters(offline).samples)
        counters = {**self.counters.state(), "samples_generated_before": generated}
        ledger = self.mirror.ledger.state() if offline else self.schedule.ledger.state()
        return PolicyState(version=self.version, counters=counters, ledger=ledger,
                           eval_history=list(self.monitor.eval_history), rewards=self.monitor.reward_state())

    def mirror_redis(self) -> None:
        """Keep what a checkpoint and the summary need from Redis in `mirror`: the ledger read now, the workers'
        counters as the monitor last read them."""
        counts = self.monitor.worker_counters()
        self.mirror = RedisMirror(LedgerMirror(*self.schedule.ledger.snapshot()), counts.rollout, counts.reward)

    def _rollout_counters(self, offline: bool) -> RolloutCounters:
        """This attempt's rollout counters: from Redis, or mirrored with at least the samples the stage accounted
        for (those trained after the mirror was read may have been generated after it)."""
        if not offline:
            return self.monitor.rollout_counters.read()
        accounted = _accounted(self.counters) - self.counters.samples_generated_before
        return replace(self.mirror.rollout, samples=max(self.mirror.rollout.samples, float(accounted)))

    @property
    def since_scored_s(self) -> float:
        """Seconds since a scored sample last arrived (since the stage started, before one)."""
        return time.monotonic() - self._last_scored

    @property
    def done(self) -> bool:
        return not self._steps and (self.version >= self.rl.max_steps or self.idle)

    @property
    def idle(self) -> bool:
        """No sample was scored for `rl.idle_timeout_s` (when set): the stage's sources have stopped."""
        return bool(self.rl.idle_timeout_s) and self.since_scored_s >= self.rl.idle_timeout_s

    @property
    def step_refs(self) -> List[ray.ObjectRef]:
        """The result refs of the oldest learner step in flight, the next to end (empty when none is)."""
        return self._steps[0].refs if self._steps else []

    @property
    def steps_in_flight(self) -> int:
        return len(self._steps)

    def absorb(self, scored: ResultMeta) -> None:
        self._last_scored = time.monotonic()
        if self.rl.overlong_buffer:
            scored = _shaped(scored, self.job.env.completion_tokens(self.rl.max_new_tokens), self.rl.overlong_buffer)
        self.buffer.add(scored)
        if self.buffer.completed:
            self.group_deadline.completed(self.buffer.completed, time.time())  # the ledger's clock
            self.buffer.completed = []
        self.error_guard.scored(scored)
        self.counters.samples_dropped_expired = self.buffer.samples_expired
        _count_scored(scored, self.counters)
        self._forget_expired()

    def _forget_expired(self) -> None:
        """Delete the stored results of expired groups' samples."""
        if self.buffer.forgotten:
            self.queue.results.delete(self.buffer.forgotten)
            self.buffer.forgotten = []

    def watch(self) -> None:
        """Every few seconds: expire groups incomplete past their deadline since their claim (`GroupDeadline`; an
        issued group's prompt is issued again; an agent's group claimed at its first finished episode has none)."""
        if time.monotonic() - self._last_watch < 2.0:
            return
        self._last_watch = time.monotonic()
        self._heed(self.error_guard.waiting(self._last_watch))
        self.group_deadline.seen(self.schedule.ledger.open_since())
        expired = []
        for group_id in self.group_deadline.overdue(time.time()):
            if self.buffer.is_complete(group_id):
                continue
            if self.schedule.expired(group_id):
                self.buffer.expire(group_id)
                self.group_deadline.expired(group_id)
                self.counters.groups_expired += 1
                expired.append(group_id)
        if expired:
            self.metrics.event("groups_expired", expired_groups(self.workers.name, expired, self.group_deadline),
                               self.version)
        for message in agents_gone(self.queue.client, self.workers.keys.agent_episodes_expired):
            self.metrics.event("agent_episodes_expired", message, self.version)
        self.counters.samples_dropped_expired = self.buffer.samples_expired
        self._forget_expired()

    def advance(self) -> bool:
        """Finish the oldest learner step if it has ended (and send the next), else send the next if fewer than
        `STEPS_IN_FLIGHT` are in flight and a batch is ready; True if either happened. One new step per call at
        most: between calls, `Checkpoints.maybe_save` counts the steps in flight against its boundary."""
        if self._steps and self._finish_step():
            return True
        return self._start_step()

    def _start_step(self) -> bool:
        version = self.version + len(self._steps)  # the version this step starts from
        if len(self._steps) >= STEPS_IN_FLIGHT or version >= self.rl.max_steps or self.hold:
            return False
        sampling = self.rl.dynamic_sampling and \
            self._signal_drops < self.rl.dynamic_sampling_limit * self.rl.batch_prompts
        teacher_version = self._teacher_version()
        batch = self.buffer.take(version, self.rule, filter_zero_advantage=sampling, teacher_version=teacher_version)
        self._signal_drops += len(batch.dropped_zero_advantage)
        _drop(batch, self.counters, self.schedule)
        self.queue.results.delete(batch.dropped_ids())
        if not batch.groups:
            if not self._steps:
                self.monitor.idle(self.version)
            return False
        batch.signal_drops, self._signal_drops = self._signal_drops, 0
        self.counters.groups_in_batches += len(batch.groups)
        self.counters.groups_with_signal += sum(map(has_signal, batch.groups))
        rewards = [[s.reward for s in group] for group in batch.groups]
        advantages = [a for group in _advantages(self.rl, rewards) for a in group]
        distilling = self.teacher is not None and (self.teacher_guard is None or self.teacher_guard.distilling())
        if distilling and not self.workers.config.distill.task_reward:  # the teacher's per-token signal alone
            advantages = [0.0] * len(advantages)
        sft_rows = random.Random(version).sample(self.train_rows, self.rl.batch_prompts) \
            if self.rl.sft_coef else None
        items = [TrainItem(s.sample_id, a, s.tokens) for s, a in zip(batch.samples, advantages)]
        refs = self.workers.learner.rl_step_async(items, self.rl, sft_rows, step=version,
                                                  max_tokens=self.job.env.completion_tokens(self.rl.max_new_tokens),
                                                  distill=distilling)
        self.counters.steps_queued += bool(self._steps)
        self._steps.append(StepInFlight(refs, batch, version, time.perf_counter()))
        return True

    def _distill_totals(self) -> Dict:
        totals = self.monitor.distill_totals()
        if totals and self.teacher_guard is not None:
            totals["steps_paused"] = self.teacher_guard.steps_paused
        return totals

    def _teacher_version(self) -> Optional[int]:
        """The teacher's newest published version (on-policy distillation; None without a teacher)."""
        if self.teacher_keys is None:
            return None
        published = self.queue.client.get(self.teacher_keys.version)
        return None if published is None else int(published)

    def _finish_step(self) -> bool:
        step = self._steps[0]
        if len(ray.wait(step.refs, num_returns=len(step.refs), timeout=0)[0]) < len(step.refs):
            return False
        result, snapshot = self.workers.learner.gather(step.refs)
        self._steps.popleft()
        gaps = self._count_trained(step, result)
        batch = self._unrecorded = step.batch  # counted: recorded below, unless the job's Redis goes away first
        self._heed(self.error_guard.stepped())
        self._start_step()  # the learner is running the queued step, if any: queue the next while this one is recorded
        # the rollout workers wait for these weights to generate the next batch: they go out before the records
        publish_s = publish(self.workers, self.queue.client, self.version, snapshot,
                            deadline_s=self.publish_deadline_s())
        self.counters.weight_publish_s += publish_s
        self.longest_publish_s = max(self.longest_publish_s, publish_s)
        self._record_trained(batch)
        self._unrecorded = None
        self._evaluate_in_background()
        self.monitor.step(self.version, result, batch, gaps, self.counters, publish_s=publish_s)
        self.queue.results.delete(s.sample_id for s in batch.samples)
        self.mirror_redis()
        return True

    def _count_trained(self, step: StepInFlight, result) -> List[int]:
        """Count an ended learner step: the learner's time, the samples trained and their staleness, the version;
        returns how many versions behind the weights each sample was."""
        ended = time.perf_counter()
        busy = ended - max(step.sent, self._last_step_end)  # a queued step started when the one before it ended
        self.counters.learner_busy_s += busy
        self.longest_step_s = max(self.longest_step_s, busy)
        self._last_step_end = ended
        self.counters.learner.add(result)
        self.first_step_at = self.first_step_at or time.time()
        self.counters.samples_trained += len(step.batch.samples)
        gaps = [step.version - s.version for s in step.batch.samples]
        self.counters.staleness_trained.update(gaps)
        self.version += 1
        return gaps

    def finish_steps_offline(self) -> bool:
        """The job's Redis went away: wait for the learner steps in flight (`step_deadline_s` each) and count those
        the learner applied, their groups closed as trained in the mirrored ledger (a resume does not issue them
        again). A step whose ranks could not fetch its samples applied nothing. False if a step did not end: the
        learner then holds weights no checkpoint can take. A step counted before Redis went away, but not yet
        recorded, is recorded as those are."""
        if self._unrecorded is not None:
            self._log_trained(self._unrecorded, self.mirror.ledger.close_trained(self._unrecorded.group_positions()))
            self._unrecorded = None
        while self._steps:
            step = self._steps.popleft()
            ended, _ = ray.wait(step.refs, num_returns=len(step.refs), timeout=self.step_deadline_s())
            if len(ended) < len(step.refs):
                return False
            try:
                result, _ = self.workers.learner.gather(step.refs)
            except ray.exceptions.RayTaskError:
                continue
            self._count_trained(step, result)
            self._log_trained(step.batch, self.mirror.ledger.close_trained(step.batch.group_positions()))
        return True

    def learner_hang(self, checkpoint: Optional[str]) -> Optional[LearnerHung]:
        """The learner's hang, once the step it runs made no progress past the watchdog's deadline: the longest
        step so far (before one ended, the learner's set-up) times `monitoring.hang_factor`; its ranks' stacks are
        dumped. None while it has not, or the watchdog is off."""
        if not self._steps or self.hang_rule is None:
            return None
        running = time.perf_counter() - max(self._steps[0].sent, self._last_step_end)
        longest = self.longest_step_s or self.workers.learner.set_up_s
        if running < self.hang_rule.deadline_s(longest):  # every turn: the ranks are looked up only once hung
            return None
        return learner_hang(self.hang_rule, self.job.run_dir, self._learner_ranks(), running, "a step",
                            longest_s=longest, checkpoint=checkpoint)

    def save_learner(self, directory: str, checkpoint: Optional[str]) -> None:
        """The learner's part of a checkpoint, written to `directory`; with the watchdog on, a write that takes
        `monitoring.hang_factor` times the longest so far (before one, times `monitoring.hang_floor_s`) is the
        learner's hang (`checkpoint`: the newest one before it)."""
        started = time.perf_counter()
        watched_call(self.hang_rule, self.job.run_dir, self._learner_ranks, "writing a checkpoint", self.longest_save_s,
                     checkpoint=checkpoint,
                     call=lambda deadline_s: self.workers.learner.save(directory, timeout_s=deadline_s))
        self.longest_save_s = max(self.longest_save_s, time.perf_counter() - started)

    def _learner_ranks(self) -> List[LearnerProcess]:
        return rank_processes(self.workers.name, self.workers.learner.processes)

    def publish_deadline_s(self) -> float:
        """How long the weight store may take to take a version: the job's deadline rule on the longest a
        publish took so far; before the first was measured, the weight store's own limit."""
        if not self.longest_publish_s:
            return WEIGHTS_TIMEOUT_S
        return self.deadline_rule.deadline_s(self.longest_publish_s)

    def step_deadline_s(self) -> float:
        """How long a learner step in flight may take to end once the job's Redis went away: its ranks' reconnect
        time (a step that could not fetch its samples ends when they give up), plus 4x the longest step so far and
        a minute; before any step ended, the learner's own limit."""
        if not self.longest_step_s:
            return LEARNER_TIMEOUT_S
        return self.job.redis.reconnect_s + 4 * self.longest_step_s + 60.0

    def _heed(self, verdict: Optional[Verdict]) -> None:
        """The reward error guard's alert goes to the event log (console, W&B); a stop holds new steps and
        is the job's failure once the stage has checkpointed."""
        if verdict is None:
            return
        self.metrics.event(f"reward_errors_{verdict.kind}", verdict.message, self.version)
        if verdict.kind == "stop" and self.failure is None:
            self.failure, self.hold = verdict.message, True

    def _record_trained(self, batch: Batch) -> None:
        """Close the batch's groups in the ledger, and in its mirror (a Redis lost before the mirror's next read
        leaves them closed there too), and append its sample ids and the groups' prompt positions (null for a group
        the ledger had already closed) to trained.jsonl."""
        self._log_trained(batch, self.schedule.trained(batch.group_ids()))
        self.mirror.ledger.close_trained(batch.group_positions())

    def _log_trained(self, batch: Batch, prompts: List[Optional[int]]) -> None:
        """Append the step's sample ids and its groups' prompt positions (None for a group the ledger did not hold
        open) to trained.jsonl."""
        with open(self.trained_log, "a") as f:
            f.write(json.dumps({"step": self.version, "sample_ids": [s.sample_id for s in batch.samples],
                                "prompts": prompts}) + "\n")

    def _evaluate_in_background(self) -> None:
        if self.workers.evaluator is None:
            return
        finished = self.workers.evaluator.poll()
        if finished:
            self.monitor.evaluation(*finished)
        every = self.job.eval.every_steps
        if every and self.version % every == 0 and self.version < self.rl.max_steps:
            self.workers.evaluator.start()

    def finish_evaluation(self) -> None:
        """Wait for the in-run evaluation under way, if any, and record it (`eval_history`)."""
        finished = self.workers.evaluator.finish_pending() if self.workers.evaluator else None
        if finished:
            self.monitor.evaluation(*finished)

    def summary(self, end: StageEnd, unused: Optional[Dict[str, int]] = None, offline: bool = False) -> RLSummary:
        """The stage's figures once every worker has stopped (worker counters from Redis alone), with where its
        untrained samples were left (`unused`). Without `unused`, the figures of a stage that failed, as they
        stood: the samples generated and not accounted for were in flight. `offline`: the job's Redis went
        away, Redis's part comes from the mirror."""
        rollout = self._rollout_counters(offline)
        failed = unused is None
        if failed:
            generated = self.counters.samples_generated_before + int(rollout.samples)
            unused = {"in_flight_at_failure": max(generated - _accounted(self.counters), 0)}
        wall = time.perf_counter() - self.start
        figures = stage_figures(self.counters, rollout, len(self.workers.rollout), unused, self.version, wall=wall,
                                trained_at_start=self.trained_at_start,
                                group_deadline_s=self.group_deadline.deadline_s())
        if self.elastic is not None:  # None before the stage's loops start
            figures = replace(figures, **self.elastic.figures())
        reward_now = self.mirror.reward if offline else self.queue.counters(self.queue.keys.reward_stats)
        reward = {k: v - self._reward_counters_at_start.get(k, 0.0) for k, v in reward_now.items()}
        ledger = self.mirror.ledger.counts() if offline \
            else self.schedule.ledger.counts()
        ended_by = "failed" if failed else "max_steps" if self.version >= self.rl.max_steps \
            else "idle_timeout" if self.idle else "stop"
        time_breakdown = {
            "generation_s": round(rollout.busy_s, 2),
            "queue_submit_s": round(rollout.submit_s, 2),
            "reward_busy_s": round(reward.get("busy_s", 0.0), 2),  # all policies' reward work
            "reward_latency_s_mean": round(reward.get("latency_s", 0.0) / max(reward.get("scored", 0.0), 1.0), 4),
            "learner_step_s": round(self.counters.learner_busy_s, 2),
            "weight_publish_s": figures.weight_publish_s, "weight_sync_s": figures.weight_sync_s}
        return RLSummary(
            steps=self.version, wall_s=round(wall, 2), figures=figures, time_breakdown=time_breakdown,
            eval_history=self.monitor.eval_history, parity=self.monitor.parity_totals(),
            rewards=self.monitor.reward_totals(), ledger=ledger, first_step_at=self.first_step_at, ended_by=ended_by,
            tools=self.monitor.tool_totals() if self.job.env.multi_turn else None,
            restarts={"rollout": 0, "reward": 0, **end.restarts, "evaluator": self.workers.evaluator_restarts},
            checkpoint=end.checkpoint, results_held_at_end=end.results_held, controller_cpu_s=end.controller_cpu_s,
            wandb_dir=end.wandb_dir, distill=self._distill_totals())


@dataclass
class Resume:
    """A checkpoint to continue from: its path and its state.json; `set_aside`: a line for each newer checkpoint
    found corrupt and set aside."""
    path: str
    state: CheckpointState
    set_aside: List[str] = field(default_factory=list)

    @property
    def attempt(self) -> int:
        return self.state.attempt + 1


def run_rl(job: JobConfig, policies: List[PolicyWorkers], queue: RewardQueue, reward_actors: List,
           metrics: Metrics, *, train_rows: List[Dict], stop: StopSignals, job_state: Callable[[], Dict],
           restart: RestartDeadline, resume: Optional[Resume] = None,
           tool_actors: Sequence = ()) -> Dict[str, RLSummary]:
    """Train every policy to `rl.max_steps` from its version 0 (already published) or from `resume`,
    learner steps of different policies running at once, checkpoints every `checkpoint.every_steps`
    and at the end; a stop signal ends it early, checkpointed. `job_state()`: the job's own part of each
    checkpoint's state, as it stands when the checkpoint is written; `tool_actors`, serving since they were built, are
    restarted when they hang; `restart` bounds a dead worker's return. Returns each policy's summary by name.
    An error ends it checkpointed too (from the learner's memory and the Redis mirror when the job's Redis went
    away; not when a learner rank died or hung), as `StageFailed` with the figures as they stood."""
    controller_cpu_start = time.process_time()
    metrics.begin("rl")
    _await_construction([actor for p in policies for actor in p.rollout + p.teachers] + reward_actors,
                        restart.seconds)
    runs = {p.name: PolicyRun(job, p, queue, metrics, train_rows) for p in policies}
    for run in runs.values():
        if run.teacher is not None and run.teacher.name in runs:  # a teacher that trains RL beside its student
            run.teacher_guard = TeacherGuard(run.workers.name, run.teacher.name, runs[run.teacher.name].monitor.alerts,
                                             metrics.event)
    attempt = resume.attempt if resume else 0
    for name, run in runs.items():
        if resume:
            run.restore(resume.state.policies[name], resume.path, attempt)
        else:
            _keep_lines(run.trained_log, 0)  # a fresh start: nothing trained yet
        run.monitor.started(run.version)
        run.mirror_redis()
    supervisor = _start_loops(job, policies, reward_actors, metrics, tool_actors, restart=restart)
    capacity_note = partial(metrics.event, "rollout_capacity")
    heartbeats = Heartbeats(queue.client, queue.keys.run)
    for workers in policies:
        runs[workers.name].elastic = ElasticRollout(job.name, workers, runs[workers.name].schedule, supervisor.start,
                                                    capacity_note, heartbeats=heartbeats)
    attach_desk = AttachDesk(AttachRequests(queue.client, queue.keys),
                             {name: run.elastic for name, run in runs.items()}, capacity_note)
    checkpoints = Checkpoints(job, runs, job_state, attempt)
    rule = hang_rule(job.monitoring)
    watch = WorkerWatch(SilentWorkers(heartbeats, job.monitoring.worker_silent_s),
                        ScoringStall(heartbeats, job.monitoring.scoring_stall_s,
                                     {spec.label: spec.timeout_s for spec in job.rewards}), queue, metrics,
                        WorkerWatchdog(rule, job.run_dir, supervisor.restart_hung) if rule else None, restart=restart)
    failed = partial(_as_they_stood, runs, supervisor, checkpoints, controller_cpu_start, metrics)
    try:
        with stop.polled():
            while not all(run.done for run in runs.values()) and not stop.requested and not _failure(runs):
                _turn(runs, queue)
                supervisor.check()
                attach_desk.check()
                for run in runs.values():
                    run.elastic.check()
                    run.monitor.rollout_workers = len(run.workers.rollout)  # busy fractions: over those there now
                watch.check(max(run.version for run in runs.values()),
                            min(run.since_scored_s for run in runs.values()))
                for run in runs.values():
                    run.group_deadline.recovery_s = watch.recovery_s
                _check_learners(runs, checkpoints.latest)
                checkpoints.maybe_save()
            checkpoints.save_now()
    except RedisUnavailable as lost:
        saved = checkpoints.save_offline()
        kept = f"checkpoint {saved} written from the learner's memory" if saved else \
            f"a learner step did not end, so no checkpoint could be written ({_newest(checkpoints.latest)})"
        raise StageFailed(f"{lost}; {kept}; resume with `rlp run --resume {job.run_dir}` once it is back",
                          failed(offline=True), redis_lost=True) from None
    except LearnerHung as hung:  # no checkpoint can be taken from it; the figures are Redis's
        metrics.event("hang", str(hung))
        raise StageFailed(str(hung), failed(), hung.exit_code) from None
    except (LearnerDied, WorkerHung, DiskFull):  # the learner's weights cannot be saved, a wait would not end, or
        raise  # the checkpoint that failed says what is intact
    except Exception as err:
        if stop.requested:  # a second signal's Interrupted surfacing through library code: end at once
            raise
        checkpoints.save_now()
        raise StageFailed(f"{_one_line(err)}; resume with `rlp run --resume {job.run_dir}` (checkpoint "
                          f"{checkpoints.latest})", failed()) from err
    watch.clear()
    if _failure(runs):
        raise StageFailed(f"{_failure(runs)}; fix the reward, then resume with `rlp run --resume {job.run_dir}` "
                          f"(checkpoint {checkpoints.latest})", failed())
    queue.request_stop()
    for run in runs.values():
        run.elastic.cancel_pending()
    end_rule, beats = deadline_rule(job.monitoring), heartbeats.beats()
    for kind in ("reward", "rollout", "teacher"):
        try:
            supervisor.wait_ended(kind, STOP_GRACE_S if stop.requested else end_deadline_s(end_rule, beats, kind))
        except WorkerHung:
            if not stop.requested:
                raise
            metrics.console.note(f"{kind} workers still inside a call {STOP_GRACE_S:g}s after the stop: stopped "
                                 f"with it (what they held counts as unscored)")
    unused = _unused_at_end(runs, queue)
    end = StageEnd(supervisor.restarts, checkpoints.latest, queue.results.held(),
                   round(time.process_time() - controller_cpu_start, 3), metrics.wandb_dir)
    summaries = {name: run.summary(end, unused[name]) for name, run in runs.items()}
    if stop.requested:
        return summaries
    for run in runs.values():  # an in-run evaluation still under way joins each curve, after the stage's figures
        run.finish_evaluation()
    return {name: replace(summary, eval_history=runs[name].monitor.eval_history)
            for name, summary in summaries.items()}


def _as_they_stood(runs: Dict[str, PolicyRun], supervisor: Supervisor, checkpoints: "Checkpoints",
                   controller_cpu_start: float, metrics: Metrics, *, offline: bool = False) -> Dict[str, RLSummary]:
    """Each policy's figures of a stage that failed (`PolicyRun.summary`); the results held are those in the
    buffers (the stored ones are Redis's)."""
    end = StageEnd(supervisor.restarts, checkpoints.latest, sum(run.buffer.held_samples() for run in runs.values()),
                   round(time.process_time() - controller_cpu_start, 3), metrics.wandb_dir)
    return {name: run.summary(end, offline=offline) for name, run in runs.items()}


def _one_line(err: Exception) -> str:
    """An error as one plain line: a failed Ray task's as the worker's own error, its first line."""
    cause = getattr(err, "cause", None) or err
    lines = plain_text(str(cause)).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0] if lines else ''}"


def _newest(checkpoint: Optional[str]) -> str:
    return f"newest checkpoint {checkpoint}" if checkpoint else "no checkpoint yet"


class WorkerWatch:
    """Every few seconds: names rollout and reward workers gone silent, and a reward queue that stalled, in an
    alert (and the silent workers in the job status); the watchdog, when on, recovers hung workers. `recovery_s`:
    the longest recovering a worker may take now, its hang deadline (the longest of the workers') and its restart."""

    def __init__(self, silent: SilentWorkers, stall: ScoringStall, queue: RewardQueue, metrics: Metrics,
                 watchdog: Optional[WorkerWatchdog], *, restart: RestartDeadline) -> None:
        self.silent, self.stall, self.queue, self.metrics = silent, stall, queue, metrics
        self.watchdog, self.restart = watchdog, restart
        self.recovery_s = restart.seconds
        self._last = time.monotonic()

    def check(self, step: int, since_scored_s: float) -> None:
        """`since_scored_s`: seconds since the stage last received a scored sample."""
        if time.monotonic() - self._last < 2.0:
            return
        self._last = time.monotonic()
        beats = self.silent.heartbeats.beats()
        for message in self.watchdog.check(beats) if self.watchdog else []:
            self.metrics.event("hang", message, step)
        hang_s = max((self.watchdog.deadline_s(beat) for beat in beats), default=0.0) if self.watchdog else 0.0
        self.recovery_s = hang_s + self.restart.seconds
        for message in self.silent.newly_silent():
            self.metrics.event("worker_silent", message, step)
        stalled = self.stall.check(self.queue.pending(), since_scored_s)
        if stalled:
            self.metrics.event("scoring_stalled", stalled, step)
        self._show(self.silent.listing())

    def clear(self) -> None:
        """The stage is over: the status no longer lists silent workers."""
        self._show("")

    def _show(self, listing: str) -> None:
        if self.metrics.status is not None:
            self.metrics.status.show_silent_workers(listing)


def end_deadline_s(rule: HangRule, beats: List[Beat], kind: str) -> float:
    """How long the `kind` workers may take at the stage's end to finish what they hold and stop: the rule on the
    longest round any of them went between two beats (before any, its floor)."""
    return rule.deadline_s(max((beat.longest_round_s for beat in beats if beat.worker.startswith(f"{kind} worker ")),
                               default=0.0))


def _await_construction(actors: List, timeout_s: float) -> None:
    """Wait (at most `timeout_s`) until `actors` are constructed (a rollout worker has loaded its model), so the
    stage's clock starts with its workers ready and its first batch is generation, not start-up. An actor whose
    construction failed or hangs is the supervisor's to restart or report once its loop starts."""
    ready = [actor.__ray_ready__.remote() for actor in actors]
    ray.wait(ready, num_returns=len(ready), timeout=timeout_s)


def _start_loops(job: JobConfig, policies: List[PolicyWorkers], reward_actors: List, metrics: Metrics,
                 tool_actors: Sequence, *, restart: RestartDeadline) -> Supervisor:
    supervisor = Supervisor(lambda text: metrics.event("worker_restart", text), restart, tool_actors)
    for workers in policies:
        for i, actor in enumerate(workers.rollout):
            supervisor.start("rollout", f"{workers.name}-{i}", actor)
        for i, actor in enumerate(workers.teachers):
            supervisor.start("teacher", f"{workers.name}-teacher-{i}", actor)
    for i, actor in enumerate(reward_actors):
        supervisor.start("reward", f"{job.name}-reward-{i}", actor)
    return supervisor


def _turn(runs: Dict[str, PolicyRun], queue: RewardQueue) -> None:
    """One turn of the loop: wait for new results or a learner step's end, whichever comes first (at most
    `TURN_WAIT_MS`), then route the results and finish or start learner steps, expire late groups."""
    results, stepped = queue.await_results(block_ms=TURN_WAIT_MS)
    ended = [ref for name in stepped if name in runs for ref in runs[name].step_refs]
    if ended:  # announced as the learner returns: its result lands a moment later
        ray.wait(ended, num_returns=len(ended), timeout=STEP_RESULT_WAIT_S)
    for scored in results:
        if scored.policy in runs:
            runs[scored.policy].absorb(scored)
    for run in runs.values():
        run.advance()
        run.watch()


class Checkpoints:
    """When to checkpoint and what: at every multiple of `checkpoint.every_steps` of any policy, and at the end.

    A checkpoint is taken between learner steps: when one is due, no new step starts until
    every step in flight has ended, then all policies are saved together."""

    def __init__(self, job: JobConfig, runs: Dict[str, PolicyRun], job_state: Callable[[], Dict],
                 attempt: int) -> None:
        self.job, self.runs, self.job_state, self.attempt = job, runs, job_state, attempt
        self.saved = {name: run.version for name, run in runs.items()}
        self.latest: Optional[str] = latest_checkpoint(job.run_dir)

    def maybe_save(self) -> None:
        """Save at each multiple of `checkpoint.every_steps`: once the steps in flight reach it, no step
        starts past it, and the save follows when no step is in flight."""
        every = self.job.checkpoint.every_steps
        if not every:
            return
        due = False
        for name, run in self.runs.items():
            boundary = (self.saved[name] // every + 1) * every
            if run.version + run.steps_in_flight >= boundary:
                run.hold = True
                due = due or run.version >= boundary
        if due and not any(run.step_refs for run in self.runs.values()):
            self._save()

    def save_now(self) -> None:
        """Let the steps in flight end, then save (the stage's end, or a stop)."""
        for run in self.runs.values():
            run.hold = True
        while any(run.step_refs for run in self.runs.values()):
            _turn(self.runs, self.runs[next(iter(self.runs))].queue)
            _check_learners(self.runs, self.latest)
        if self.latest and all(run.version == self.saved[name] for name, run in self.runs.items()):
            for run in self.runs.values():  # no step since the last checkpoint, which stands
                run.hold = False
            return
        self._save()

    def save_offline(self) -> Optional[str]:
        """The job's Redis went away: let the learner steps in flight end, then checkpoint from the learner's memory
        and the Redis mirror; returns the checkpoint, or None when a learner step did not end."""
        if not all(run.finish_steps_offline() for run in self.runs.values()):
            return None
        self._save(offline=True)
        return self.latest

    def _save(self, offline: bool = False) -> None:
        state = CheckpointState(**self.job_state(), attempt=self.attempt,
                                policies={name: run.state(offline) for name, run in self.runs.items()})
        step = sum(run.version for run in self.runs.values())
        self.latest = write_checkpoint(self.job.run_dir, step, state, self._save_learners,
                                       self.job.checkpoint.keep_last)
        for name, run in self.runs.items():
            self.saved[name] = run.version
            run.hold = False
        next(iter(self.runs.values())).metrics.console.note(f"checkpoint {self.latest}")

    def _save_learners(self, directory: str) -> None:
        for name, run in self.runs.items():
            run.save_learner(os.path.abspath(learner_dir(directory, name)), self.latest)


def _shaped(scored: ResultMeta, max_tokens: int, buffer: int) -> ResultMeta:
    """`scored` with DAPO's overlong penalty added to its reward, and as its `overlong_penalty` component."""
    penalty = overlong_penalty(scored.completion_tokens, max_tokens, buffer)
    return replace(scored, reward=scored.reward + penalty, components={**scored.components, "overlong_penalty": penalty})


def _check_learners(runs: Dict[str, PolicyRun], checkpoint: Optional[str]) -> None:
    """Raise `LearnerHung` for a policy whose learner step ran past the watchdog's deadline (none when it is off)."""
    for run in runs.values():
        hung = run.learner_hang(checkpoint)
        if hung:
            raise hung


def _failure(runs: Dict[str, PolicyRun]) -> Optional[str]:
    """Why the stage must stop (a policy's reward error guard), naming the policy in a multi-policy job."""
    failed = [(name, run.failure) for name, run in runs.items() if run.failure]
    if not failed:
        return None
    name, message = failed[0]
    return message if len(runs) == 1 else f"policy '{name}': {message}"


def _advantages(rl, rewards: List[List[float]]) -> List[List[float]]:
    if rl.algorithm == "grpo":
        return grpo_advantages(rewards, rl.std_normalize)
    return ADVANTAGE_ESTIMATORS[rl.algorithm](rewards)


def _count_scored(scored: ResultMeta, counters: RLCounters) -> None:
    counters.samples_scored += 1
    counters.reward_errors += scored.error is not None
    counters.reward_timeouts += "timeout" in (scored.error or "").lower()
    counters.samples_filtered += scored.filtered
    counters.reward_reasons.update(f"{label}/{reason}" for label, reason in scored.reasons.items())


def _drop(batch: Batch, counters: RLCounters, schedule: GroupSchedule) -> None:
    """Count the batch's dropped samples and end their groups, each with its reason."""
    counters.samples_dropped_stale += sum(len(g) for g in batch.dropped_stale)
    counters.samples_dropped_error += sum(len(g) for g in batch.dropped_errors)
    counters.samples_dropped_zero_advantage += sum(len(g) for g in batch.dropped_zero_advantage)
    counters.samples_dropped_invalid += len(batch.dropped_invalid)
    for outcome, groups in (("dropped_stale", batch.dropped_stale), ("dropped_error", batch.dropped_errors),
                            ("dropped_zero_advantage", batch.dropped_zero_advantage)):
        for group in groups:
            schedule.dropped(group[0].group_id, outcome)


def _unused_at_end(runs: Dict[str, "PolicyRun"], queue: RewardQueue) -> Dict[str, Dict[str, int]]:
    """Where each policy's untrained samples sit once every worker has stopped: in its buffer,
    scored but not yet read from the results stream, or never scored (still queued, dead-lettered)."""
    results, unscored = queue.left_at_end()
    unread = Counter(scored.policy for scored in results)
    return {name: {"in_buffer": run.buffer.held_samples(), "scored_unread": unread[name],
                   "unscored": unscored[name]} for name, run in runs.items()}


def _accounted(counters: RLCounters) -> int:
    """Generated samples whose end the counters know: trained, dropped, or abandoned at a resume."""
    return (counters.samples_trained + counters.samples_dropped_stale + counters.samples_dropped_error
            + counters.samples_dropped_zero_advantage + counters.samples_dropped_invalid + counters.samples_abandoned)


def _keep_lines(path: str, last_step: int) -> None:
    """Drop trained.jsonl lines past `last_step`: steps trained after the checkpoint resumed from."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if json.loads(line)["step"] <= last_step]
    with open(path, "w") as f:
        f.writelines(kept)


def stage_figures(counters: RLCounters, rollout: RolloutCounters, rollout_workers: int, unused: Dict[str, int],
                  version: int, *, wall: float, trained_at_start: int, group_deadline_s: float) -> RLFigures:
    """The stage's counts and rates from the loop's counters and the rollout workers' (summed on Redis) after
    `wall` seconds of this attempt: counts over every attempt (samples_generated = trained + dropped +
    abandoned + unused), rates over this one."""
    generated = int(rollout.samples)  # by this attempt
    syncs = int(rollout.weight_syncs)
    return RLFigures(
        samples_generated=counters.samples_generated_before + generated,
        tokens_generated=int(rollout.tokens),
        samples_scored=counters.samples_scored,
        samples_trained=counters.samples_trained,
        samples_dropped_stale=counters.samples_dropped_stale,
        samples_dropped_error=counters.samples_dropped_error,
        samples_dropped_zero_advantage=counters.samples_dropped_zero_advantage,
        signal_group_fraction=round(counters.groups_with_signal / max(counters.groups_in_batches, 1), 4),
        samples_dropped_expired=counters.samples_dropped_expired,
        groups_expired=counters.groups_expired,
        group_deadline_s=round(group_deadline_s, 1),
        agent_episodes_expired=int(rollout.agent_episodes_expired),
        samples_dropped_invalid=counters.samples_dropped_invalid,
        samples_abandoned_at_resume=counters.samples_abandoned,
        samples_unused_at_end=sum(unused.values()),
        samples_unused_where=unused,
        reward_errors=counters.reward_errors,
        reward_reasons=dict(sorted(counters.reward_reasons.items())),
        policy_versions=version + 1,
        max_staleness_trained=max(counters.staleness_trained, default=0),
        staleness_histogram={str(k): v for k, v in sorted(counters.staleness_trained.items())},
        samples_per_s=round(generated / wall, 2),
        trained_per_s=round((counters.samples_trained - trained_at_start) / wall, 2),
        learner_busy_fraction=round(counters.learner_busy_s / wall, 3),
        learner_steps_queued=counters.steps_queued,
        **counters.learner.figures(),  # learner_model_tokens_per_s, learner_mfu
        rollout_busy_fraction=round(rollout.busy_s / wall / max(rollout_workers, 1), 3),
        weight_publish_s=round(counters.weight_publish_s, 3),
        weight_syncs=syncs,
        weight_sync_s=round(rollout.weight_sync_s, 3),
        weight_bytes_per_sync=round(rollout.weight_sync_bytes / max(syncs, 1)),
    )
