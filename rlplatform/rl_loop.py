"""The asynchronous RL stage: scored groups -> advantages -> learner step -> publish weights.

Rollout and reward workers run their own loops the whole time; this loop only collects
scored samples from the reward queue, hands fresh-enough batches to the learner and streams
each new version back. Samples too stale for the bound are dropped and counted.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

import ray

from rlplatform.buffer import Batch, GroupBuffer
from rlplatform.config import EvalConfig, JobConfig
from rlplatform.learners.algorithms import ADVANTAGE_ESTIMATORS, grpo_advantages
from rlplatform.learners.group import LearnerGroup
from rlplatform.metrics import Metrics
from rlplatform.reward_queue import RewardQueue
from rlplatform.rl_monitor import RLMonitor
from rlplatform.staleness import RolloutGate


@dataclass
class RLCounters:
    samples_scored: int = 0
    samples_trained: int = 0
    samples_dropped_stale: int = 0
    samples_dropped_error: int = 0
    samples_dropped_zero_advantage: int = 0
    reward_errors: int = 0
    reward_timeouts: int = 0
    samples_filtered: int = 0
    staleness_trained: Counter = field(default_factory=Counter)  # version gap -> samples
    learner_busy_s: float = 0.0
    weight_publish_s: float = 0.0


class Evaluator:
    """A spare rollout worker that measures held-out greedy accuracy without stopping training."""

    def __init__(self, actor, rows: List[Dict], config: EvalConfig) -> None:
        self.actor, self.rows, self.config = actor, rows, config
        self._pending = None
        self.last_accuracy: Optional[float] = None

    def _call(self):
        return self.actor.evaluate_latest.remote(self.rows, self.config.max_new_tokens, self.config.batch_size)

    def run_now(self) -> Tuple[int, float]:
        version, self.last_accuracy = ray.get(self._call())
        return version, self.last_accuracy

    def start(self) -> None:
        """Begin evaluating the newest weights in the background, unless one is under way."""
        if self._pending is None:
            self._pending = self._call()

    def poll(self) -> Optional[Tuple[int, float]]:
        """(version, accuracy) of a finished background evaluation, else None."""
        if self._pending is None or not ray.wait([self._pending], timeout=0)[0]:
            return None
        version, self.last_accuracy = ray.get(self._pending)
        self._pending = None
        return version, self.last_accuracy


@dataclass
class RLWorkers:
    learner: LearnerGroup
    rollout: List  # RolloutActor handles
    reward: List  # RewardActor handles
    weight_store: object  # WeightStore handle
    queue: RewardQueue
    gate: RolloutGate
    evaluator: Evaluator


def publish(workers: RLWorkers, version: int) -> float:
    """Stream the learner's current weights as `version`; returns the seconds it took."""
    start = time.perf_counter()
    ref = workers.learner.publish_weights()
    ray.get(workers.weight_store.publish.remote(version, [ref]))
    workers.queue.client.set(workers.queue.keys.version, version)
    return time.perf_counter() - start


def run_rl(config: JobConfig, workers: RLWorkers, metrics: Metrics, policy: str, train_rows: List[Dict]) -> Dict:
    """Train `rl.max_steps` steps from version 0 (already published); returns the stage's figures."""
    rl = config.rl
    workers.learner.start_stage(rl.lr, keep_reference=rl.kl_coef > 0 or rl.track_reference_kl)
    counters, buffer, start = RLCounters(), GroupBuffer(rl.group_size), time.perf_counter()
    monitor = RLMonitor(config, metrics, workers.queue, policy, len(workers.rollout))
    monitor.last_accuracy = workers.evaluator.last_accuracy
    runs = [w.run.remote() for w in workers.rollout + workers.reward]
    version = 0
    while version < rl.max_steps:
        for scored in workers.queue.read_results(block_ms=50):
            buffer.add(scored)
            _count_scored(scored, counters)
        batch = buffer.take(rl.batch_prompts, version, rl.max_staleness, rl.filter_zero_advantage)
        _count_dropped(batch, counters, workers.gate)
        if not batch.groups:
            _raise_if_worker_died(runs)
            monitor.idle(version)
            continue
        sft_rows = random.Random(version).sample(train_rows, rl.batch_prompts) if rl.sft_coef else None
        step_metrics = _train(batch, version, workers, counters, config, sft_rows)
        version += 1
        publish_s = publish(workers, version)
        counters.weight_publish_s += publish_s
        _evaluate_in_background(version, workers.evaluator, monitor, config)
        monitor.step(version, step_metrics, batch, counters, publish_s)
    workers.queue.request_stop()
    stats = ray.get(runs)
    summary = _stage_summary(counters, stats[:len(workers.rollout)], version, start)
    summary["eval_history"] = monitor.eval_history
    return summary


def _train(batch: Batch, version: int, workers: RLWorkers, counters: RLCounters, config: JobConfig,
           sft_rows: Optional[List[Dict]]) -> Dict:
    rewards = [[s.reward for s in group] for group in batch.groups]
    advantages = [a for group in _advantages(config.rl, rewards) for a in group]
    samples = [s.sample for s in batch.samples]
    start = time.perf_counter()
    step_metrics = workers.learner.rl_step(samples, advantages, config.rl, sft_rows)
    counters.learner_busy_s += time.perf_counter() - start
    counters.samples_trained += len(samples)
    counters.staleness_trained.update(version - s.version for s in samples)
    return step_metrics


def _advantages(rl, rewards: List[List[float]]) -> List[List[float]]:
    if rl.algorithm == "grpo":
        return grpo_advantages(rewards, rl.std_normalize)
    return ADVANTAGE_ESTIMATORS[rl.algorithm](rewards)


def _count_scored(scored, counters: RLCounters) -> None:
    counters.samples_scored += 1
    counters.reward_errors += scored.error is not None
    counters.reward_timeouts += "timeout" in (scored.error or "").lower()
    counters.samples_filtered += scored.filtered


def _evaluate_in_background(version: int, evaluator: Evaluator, monitor: RLMonitor, config: JobConfig) -> None:
    finished = evaluator.poll()
    if finished:
        monitor.evaluation(*finished)
    every = config.eval.every_steps
    if every and version % every == 0 and version < config.rl.max_steps:
        evaluator.start()


def _count_dropped(batch: Batch, counters: RLCounters, gate: RolloutGate) -> None:
    counters.samples_dropped_stale += sum(len(g) for g in batch.dropped_stale)
    counters.samples_dropped_error += sum(len(g) for g in batch.dropped_errors)
    counters.samples_dropped_zero_advantage += sum(len(g) for g in batch.dropped_zero_advantage)
    gate.release(len(batch.dropped_stale) + len(batch.dropped_errors) + len(batch.dropped_zero_advantage))


def _raise_if_worker_died(runs: List) -> None:
    """Worker loops only return once the job stops; one that ended early has failed."""
    finished, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
    if finished:
        ray.get(finished)  # raises the worker's error
        raise RuntimeError("a rollout or reward worker stopped before the job asked it to")


def _stage_summary(counters: RLCounters, rollout_stats: List, version: int, start: float) -> Dict:
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
        "samples_unused_at_end": generated - counters.samples_trained - counters.samples_dropped_stale
        - counters.samples_dropped_error - counters.samples_dropped_zero_advantage,
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
