"""The asynchronous RL stage: scored groups -> advantages -> learner step -> publish weights.

Rollout and reward workers run their own loops the whole time; this loop only collects
scored samples from the shared reward queue, routes them to their policy, hands each policy's
learner fresh-enough batches (several policies' steps run at once) and streams each new
version back. Samples too stale for the bound are dropped and counted.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import ray

from rlplatform.config import JobConfig
from rlplatform.job.workers import PolicyWorkers, publish
from rlplatform.learners.algorithms import ADVANTAGE_ESTIMATORS, grpo_advantages
from rlplatform.monitoring.metrics import Metrics
from rlplatform.monitoring.rl_monitor import RLMonitor
from rlplatform.transport.buffer import Batch, GroupBuffer
from rlplatform.transport.reward_queue import RewardQueue


@dataclass
class RLCounters:
    samples_scored: int = 0
    samples_trained: int = 0
    samples_dropped_stale: int = 0
    samples_dropped_error: int = 0
    samples_dropped_zero_advantage: int = 0
    samples_dropped_invalid: int = 0  # reward error or drop flag, in a group trained without them
    reward_errors: int = 0
    reward_timeouts: int = 0
    samples_filtered: int = 0
    staleness_trained: Counter = field(default_factory=Counter)  # version gap -> samples
    learner_busy_s: float = 0.0
    weight_publish_s: float = 0.0


class PolicyRun:
    """One policy's RL stage: its buffer, counters and monitor, and the learner step in flight."""

    def __init__(self, job: JobConfig, workers: PolicyWorkers, queue: RewardQueue, metrics: Metrics,
                 train_rows: List[Dict]) -> None:
        self.job, self.workers, self.queue, self.rl = job, workers, queue, workers.config.rl
        self.train_rows = train_rows
        self.counters, self.buffer = RLCounters(), GroupBuffer(self.rl.group_size)
        self.monitor = RLMonitor(job, self.rl, metrics, queue, workers.name, workers.keys, len(workers.rollout))
        self.monitor.last_accuracy = workers.evaluator.last_accuracy
        self.version, self.start = 0, time.perf_counter()
        self.first_step_at: Optional[float] = None  # wall-clock time the first learner step ended
        self._reward_counters_at_start = queue.counters(queue.keys.reward_stats)
        self._step: Optional[Tuple[list, Batch, float]] = None  # (result refs, batch, start time)
        workers.learner.start_stage(self.rl.lr, keep_reference=self.rl.kl_coef > 0 or self.rl.track_reference_kl)

    @property
    def done(self) -> bool:
        return self.version >= self.rl.max_steps and self._step is None

    @property
    def step_refs(self) -> List[ray.ObjectRef]:
        """The learner step in flight's result refs (empty when none is)."""
        return self._step[0] if self._step is not None else []

    def absorb(self, scored) -> None:
        self.buffer.add(scored)
        _count_scored(scored, self.counters)

    def advance(self) -> bool:
        """Finish the learner step in flight, or start one if a batch is ready; True if either happened."""
        if self._step is not None:
            return self._finish_step()
        return self._start_step()

    def _start_step(self) -> bool:
        if self.version >= self.rl.max_steps:
            return False
        batch = self.buffer.take(self.rl.batch_prompts, self.version, self.rl.max_staleness,
                                 self.rl.filter_zero_advantage)
        _count_dropped(batch, self.counters)
        self.workers.gate.release(batch.dropped_groups)  # dropped groups will never be trained: free their claims
        if not batch.groups:
            self.monitor.idle(self.version)
            return False
        rewards = [[s.reward for s in group] for group in batch.groups]
        advantages = [a for group in _advantages(self.rl, rewards) for a in group]
        sft_rows = random.Random(self.version).sample(self.train_rows, self.rl.batch_prompts) \
            if self.rl.sft_coef else None
        refs = self.workers.learner.rl_step_async([s.sample for s in batch.samples], advantages, self.rl, sft_rows,
                                                  step=self.version)
        self._step = (refs, batch, time.perf_counter())
        return True

    def _finish_step(self) -> bool:
        refs, batch, started = self._step
        if len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs):
            return False
        step_metrics, snapshot = self.workers.learner.gather(refs)
        self._step = None
        self.counters.learner_busy_s += time.perf_counter() - started
        self.first_step_at = self.first_step_at or time.time()
        self.counters.samples_trained += len(batch.samples)
        gaps = [self.version - s.sample.version for s in batch.samples]  # versions behind the weights trained
        self.counters.staleness_trained.update(gaps)
        self.version += 1
        self._start_step()  # the next step runs while this one's weights are published
        publish_s = publish(self.workers, self.queue.client, self.version, snapshot)
        self.counters.weight_publish_s += publish_s
        self._evaluate_in_background()
        self.monitor.step(self.version, step_metrics, batch, gaps, self.counters, publish_s)
        return True

    def _evaluate_in_background(self) -> None:
        finished = self.workers.evaluator.poll()
        if finished:
            self.monitor.evaluation(*finished)
        every = self.job.eval.every_steps
        if every and self.version % every == 0 and self.version < self.rl.max_steps:
            self.workers.evaluator.start()

    def summary(self, rollout_stats: List, unused: Dict[str, int]) -> Dict:
        summary = _stage_summary(self.counters, rollout_stats, unused, self.version, self.start)
        reward = {k: v - self._reward_counters_at_start.get(k, 0.0)
                  for k, v in self.queue.counters(self.queue.keys.reward_stats).items()}
        summary["time_breakdown"] = {
            "generation_s": round(sum(s.busy_s for s in rollout_stats), 2),
            "queue_submit_s": round(sum(s.submit_s for s in rollout_stats), 2),
            "reward_busy_s": round(reward.get("busy_s", 0.0), 2),  # all policies' reward work
            "reward_latency_s_mean": round(reward.get("latency_s", 0.0) / max(reward.get("scored", 0.0), 1.0), 4),
            "learner_step_s": round(self.counters.learner_busy_s, 2),
            "weight_publish_s": summary["weight_publish_s"], "weight_sync_s": summary["weight_sync_s"]}
        summary["eval_history"] = self.monitor.eval_history
        summary["first_step_at"] = self.first_step_at
        return summary


def run_rl(job: JobConfig, policies: List[PolicyWorkers], queue: RewardQueue, reward_actors: List,
           metrics: Metrics, train_rows: List[Dict]) -> Dict[str, Dict]:
    """Train every policy `rl.max_steps` steps from its version 0 (already published), learner steps
    of different policies running at once; returns each policy's stage figures by name."""
    runs = {p.name: PolicyRun(job, p, queue, metrics, train_rows) for p in policies}
    rollout_loops = {p.name: [w.run.remote() for w in p.rollout] for p in policies}
    loops = [ref for refs in rollout_loops.values() for ref in refs] + [w.run.remote() for w in reward_actors]
    while not all(run.done for run in runs.values()):
        in_flight = [ref for run in runs.values() for ref in run.step_refs]
        if in_flight:  # wake the moment the learner steps end; results wait in Redis meanwhile
            ray.wait(in_flight, num_returns=len(in_flight), timeout=0.02)
        for scored in queue.read_results(block_ms=None if in_flight else 20):
            if scored.sample.policy in runs:
                runs[scored.sample.policy].absorb(scored)
        progressed = [run.advance() for run in runs.values()]
        if not any(progressed):
            _raise_if_worker_died(loops)
    queue.request_stop()
    ray.get(loops)
    unused = _unused_at_end(runs, queue)
    return {name: run.summary(ray.get(rollout_loops[name]), unused[name]) for name, run in runs.items()}


def _advantages(rl, rewards: List[List[float]]) -> List[List[float]]:
    if rl.algorithm == "grpo":
        return grpo_advantages(rewards, rl.std_normalize)
    return ADVANTAGE_ESTIMATORS[rl.algorithm](rewards)


def _count_scored(scored, counters: RLCounters) -> None:
    counters.samples_scored += 1
    counters.reward_errors += scored.error is not None
    counters.reward_timeouts += "timeout" in (scored.error or "").lower()
    counters.samples_filtered += scored.filtered


def _count_dropped(batch: Batch, counters: RLCounters) -> None:
    counters.samples_dropped_stale += sum(len(g) for g in batch.dropped_stale)
    counters.samples_dropped_error += sum(len(g) for g in batch.dropped_errors)
    counters.samples_dropped_zero_advantage += sum(len(g) for g in batch.dropped_zero_advantage)
    counters.samples_dropped_invalid += len(batch.dropped_invalid)


def _unused_at_end(runs: Dict[str, "PolicyRun"], queue: RewardQueue) -> Dict[str, Dict[str, int]]:
    """Where each policy's untrained samples sit once every worker has stopped: in its buffer,
    scored but not yet read from the results stream, or never scored (still queued, dead-lettered)."""
    unread: Counter = Counter()
    while True:
        results = queue.read_results(block_ms=None)
        if not results:
            break
        unread.update(scored.sample.policy for scored in results)
    unscored = queue.unscored_by_policy()
    return {name: {"in_buffer": run.buffer.held_samples(), "scored_unread": unread[name],
                   "unscored": unscored[name]} for name, run in runs.items()}


def _raise_if_worker_died(runs: List) -> None:
    """Worker loops only return once the job stops; one that ended early has failed."""
    finished, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
    if finished:
        ray.get(finished)  # raises the worker's error
        raise RuntimeError("a rollout or reward worker stopped before the job asked it to")


def _stage_summary(counters: RLCounters, rollout_stats: List, unused: Dict[str, int], version: int,
                   start: float) -> Dict:
    wall = time.perf_counter() - start
    generated = sum(s.samples_generated for s in rollout_stats)
    return {
        "steps": version, "wall_s": round(wall, 2),
        "samples_generated": generated,
        "samples_scored": counters.samples_scored,
        "samples_trained": counters.samples_trained,
        "samples_dropped_stale": counters.samples_dropped_stale,
        "samples_dropped_error": counters.samples_dropped_error,
        "samples_dropped_zero_advantage": counters.samples_dropped_zero_advantage,
        "samples_dropped_invalid": counters.samples_dropped_invalid,
        "samples_unused_at_end": sum(unused.values()),
        "samples_unused_where": unused,
        "reward_errors": counters.reward_errors,
        "policy_versions": version + 1,
        "max_staleness_trained": max(counters.staleness_trained, default=0),
        "staleness_histogram": {str(k): v for k, v in sorted(counters.staleness_trained.items())},
        "samples_per_s": round(generated / wall, 2),
        "trained_per_s": round(counters.samples_trained / wall, 2),
        "learner_busy_fraction": round(counters.learner_busy_s / wall, 3),
        "rollout_busy_fraction": round(sum(s.busy_s for s in rollout_stats) / wall / max(len(rollout_stats), 1), 3),
        "weight_publish_s": round(counters.weight_publish_s, 3),
        "weight_sync_s": round(sum(s.weight_sync_s for s in rollout_stats), 3),
    }
