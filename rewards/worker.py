"""The reward worker: reads samples from the job's reward queue, scores them, stores the results.

Runs as a Ray actor inside a job (`RewardActor`), looping until the job's stop flag is set.
Each result holds every reward's own score and their weighted sum; a reward that raises
yields an error result (the learner skips it), and an undecodable message goes to the
dead-letter stream. Results are stored idempotently and acknowledged in one step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List

import ray

from rlplatform.config import RewardSpec
from rlplatform.redis_server import connect
from rlplatform.reward_queue import RewardQueue
from rlplatform.rewards.registry import resolve
from rlplatform.samples import Sample, ScoredSample, WireFormatError


@dataclass
class RewardStats:
    scored: int = 0
    errors: int = 0
    dead_letters: int = 0
    busy_s: float = 0.0


class RewardWorker:
    def __init__(self, name: str, rewards: List[RewardSpec], redis_url: str, job: str,
                 batch_size: int = 64) -> None:
        self.name = name
        self.rewards = resolve(rewards)
        self.queue = RewardQueue(connect(redis_url), job)
        self.queue.create_group()
        self.batch_size = batch_size
        self.stats = RewardStats()

    def score(self, sample: Sample) -> ScoredSample:
        components, total = {}, 0.0
        for name, weight, fn in self.rewards:
            try:
                components[name] = float(fn(sample))
            except Exception as err:  # a user's reward may raise anything; the sample records it
                return ScoredSample(sample, 0.0, components, error=f"{name}: {type(err).__name__}: {err}")
            total += weight * components[name]
        return ScoredSample(sample, total, components)

    def step(self, block_ms: int = 100) -> int:
        """Score one batch from the queue; returns how many messages were handled."""
        messages = self.queue.fetch(self.name, self.batch_size, block_ms)
        start = time.perf_counter()
        done = []
        for msg_id, raw in messages:
            try:
                sample = self.queue.decode(raw)
            except WireFormatError as err:
                self.queue.dead_letter(msg_id, raw, str(err))
                self.stats.dead_letters += 1
                continue
            scored = self.score(sample)
            scored.scored_at = time.time()
            self.stats.errors += scored.error is not None
            done.append((msg_id, scored))
        self.queue.store_results(done)
        self.stats.scored += len(done)
        if messages:
            busy = time.perf_counter() - start
            self.stats.busy_s += busy
            latency = sum(s.scored_at - s.sample.created_at for _, s in done)
            self.queue.add_counters(self.queue.keys.reward_stats, busy_s=busy, scored=len(done), latency_s=latency)
        return len(messages)

    def run(self) -> RewardStats:
        while not self.queue.stop_requested():
            self.step()
        return self.stats


RewardActor = ray.remote(RewardWorker)
