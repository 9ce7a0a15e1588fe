"""Rollout workers: sample groups of completions from the newest policy and queue them for scoring.

Each worker is a Ray actor that loops until the job's stop flag is set: pull newer weights if
published, claim groups from the staleness gate, generate `group_size` completions for each
claimed prompt, and submit the samples to the reward queue. It never waits for the learner
except when the staleness bound says any more samples would arrive too old.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Dict, List

import ray
import torch

from rlplatform.actors.engine import TransformersEngine
from rlplatform.config import RLConfig, RolloutConfig
from rlplatform.redis_server import connect
from rlplatform.reward_queue import PolicyKeys, RewardQueue
from rlplatform.samples import Sample
from rlplatform.staleness import RolloutGate
from rlplatform.weights import from_snapshot


@dataclass
class RolloutStats:
    samples_generated: int = 0
    groups_generated: int = 0
    tokens_generated: int = 0
    busy_s: float = 0.0  # time spent generating
    weight_syncs: int = 0
    weight_sync_s: float = 0.0


class RolloutWorker:
    def __init__(self, index: int, policy: str, model_path: str, rows: List[Dict], rl: RLConfig,
                 rollout: RolloutConfig, redis_url: str, job: str, weight_store, seed: int) -> None:
        torch.set_num_threads(rollout.num_threads)
        torch.manual_seed(seed + 1000 * (index + 1))
        self.index, self.policy, self.rows, self.rl, self.rollout = index, policy, rows, rl, rollout
        self.engine = TransformersEngine(model_path)
        self.weight_store = weight_store
        client = connect(redis_url)
        self.queue = RewardQueue(client, job)
        self.keys = PolicyKeys(job, policy)
        self.gate = RolloutGate(client, job, rl.max_staleness, rl.batch_prompts, policy)
        self.rng = random.Random(seed + index)
        self.stats = RolloutStats()

    def sync_weights(self) -> int:
        """Load the newest published weights if they are newer; returns the version held."""
        published = self.queue.client.get(self.keys.version)
        if published is None or int(published) <= self.engine.version:
            return self.engine.version
        start = time.perf_counter()
        newer = ray.get(self.weight_store.newer_than.remote(self.engine.version))
        if newer is not None:
            version, (ref,) = newer
            self.engine.load_weights(from_snapshot(ray.get(ref)), version)
            self.stats.weight_syncs += 1
            self.stats.weight_sync_s += time.perf_counter() - start
        return self.engine.version

    @property
    def version(self) -> int:
        return self.engine.version

    def generate_groups(self, rows: List[Dict], group_prefix: str) -> List[Sample]:
        start = time.perf_counter()
        in_flight = self.rollout.weight_swap == "in_flight"
        groups = self.engine.generate([r["prompt"] for r in rows], self.rl.group_size, self.rl.max_new_tokens,
                                      self.rl.temperature, between_steps=self.sync_weights if in_flight else None)
        samples, now = [], time.time()
        for g, (row, completions) in enumerate(zip(rows, groups)):
            group_id = f"{group_prefix}-{g}"
            for i, c in enumerate(completions):
                samples.append(Sample(
                    sample_id=f"{group_id}/{i}", group_id=group_id, policy=self.policy,
                    prompt=row["prompt"], completion=c.text, prompt_ids=c.prompt_ids,
                    completion_ids=c.completion_ids, behaviour_logprobs=c.logprobs,
                    token_versions=c.versions, row=dict(row), created_at=now))
        busy, tokens = time.perf_counter() - start, sum(len(s.completion_ids) for s in samples)
        self.stats.busy_s += busy
        self.stats.groups_generated += len(rows)
        self.stats.samples_generated += len(samples)
        self.stats.tokens_generated += tokens
        self.queue.add_counters(self.keys.rollout_stats, busy_s=busy, samples=len(samples), tokens=tokens)
        return samples

    def run(self) -> RolloutStats:
        """Generate and submit until the job's stop flag is set."""
        batch_index = 0
        while not self.queue.stop_requested():
            self.sync_weights()
            if self.version < 0:
                time.sleep(0.05)
                continue
            granted = self.gate.claim(self.rollout.prompts_per_batch, self.version)
            if granted == 0:
                time.sleep(0.01)
                continue
            rows = [self.rng.choice(self.rows) for _ in range(granted)]
            prefix = f"{self.policy}-r{self.index}-b{batch_index}"
            self.queue.submit(self.generate_groups(rows, prefix))
            batch_index += 1
        return self.stats

    def evaluate_latest(self, rows: List[Dict], max_new_tokens: int, batch_size: int) -> tuple:
        """(version, greedy accuracy) of the newest published weights on `rows`."""
        version = self.sync_weights()
        return version, self.evaluate(rows, max_new_tokens, batch_size)

    def evaluate(self, rows: List[Dict], max_new_tokens: int, batch_size: int) -> float:
        """Greedy accuracy on `rows`: the completion, stripped, equals the row's answer."""
        correct = 0
        for i in range(0, len(rows), batch_size):
            chunk = rows[i:i + batch_size]
            outputs = self.engine.generate([r["prompt"] for r in chunk], 1, max_new_tokens, 0.0)
            correct += sum(out[0].text.strip() == str(r["answer"]).strip() for out, r in zip(outputs, chunk))
        return correct / max(len(rows), 1)


RolloutActor = ray.remote(RolloutWorker)
