"""Rollout workers: sample groups of completions from the newest policy and queue them for scoring.

Each worker is a Ray actor that loops until the job's stop flag is set: pull newer weights if
published, claim groups from the staleness gate, decode their `group_size` completions each in a
continuous batch, and submit every group to the reward queue as soon as it is complete. It never
waits for the learner except when the staleness bound says any more samples would arrive too old.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional, Tuple

import ray
import torch

from rlplatform.actors.engine import Completion, DecodeBatch, TransformersEngine
from rlplatform.config import RLConfig, RolloutConfig
from rlplatform.transport.redis_server import connect
from rlplatform.transport.reward_queue import PolicyKeys, RewardQueue
from rlplatform.transport.samples import Sample
from rlplatform.transport.staleness import RolloutGate
from rlplatform.transport.weights import from_snapshot


@dataclass
class RolloutStats:
    samples_generated: int = 0
    groups_generated: int = 0
    groups_started: int = 0
    tokens_generated: int = 0
    busy_s: float = 0.0  # time spent generating
    submit_s: float = 0.0  # time spent encoding samples and writing them to the reward queue
    weight_syncs: int = 0
    weight_sync_s: float = 0.0


@dataclass
class _OpenGroup:
    """A claimed prompt whose completions are still being decoded."""
    row: Dict
    completions: List[Optional[Completion]]


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
        self._unreported_busy_s = 0.0

    def sync_weights(self) -> int:
        """Load the newest published weights if they are newer; returns the version held."""
        if not self._newer_published():
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

    def run(self) -> RolloutStats:
        """Generate and submit until the job's stop flag is set.

        Claimed groups join the decode batch whenever a quarter of its slots are free, and each
        group is submitted the step its last completion ends, so a long completion holds up only
        its own group. With `weight_swap: finish_then_swap` no group joins while newer weights
        wait; they load once the batch has drained.
        """
        batch = self.engine.decode_batch(self.rl.max_new_tokens, self.rl.temperature)
        capacity = self.rollout.prompts_per_batch
        open_groups: Dict[str, _OpenGroup] = {}
        in_flight = self.rollout.weight_swap == "in_flight"
        while not self.queue.stop_requested():
            if in_flight or not batch:
                self.sync_weights()
            if self.version < 0:
                time.sleep(0.05)
                continue
            free = capacity - len(open_groups)
            if free >= max(1, capacity // 4) and (in_flight or not self._newer_published()):
                self._admit(batch, open_groups, self.gate.claim(free, self.version))
            if not batch:
                time.sleep(0.01)
                continue
            start = time.perf_counter()
            finished = batch.step()
            self._unreported_busy_s += time.perf_counter() - start
            samples = self._close_groups(open_groups, finished)
            if samples:
                start = time.perf_counter()
                self.queue.submit(samples)
                self.stats.submit_s += time.perf_counter() - start
        return self.stats

    def _newer_published(self) -> bool:
        """Whether the version mirrored on Redis is newer than the weights held."""
        published = self.queue.client.get(self.keys.version)
        return published is not None and int(published) > self.engine.version

    def _admit(self, batch: DecodeBatch, open_groups: Dict[str, _OpenGroup], groups: int) -> None:
        """Start `groups` claimed groups on prompts drawn from the training rows."""
        for _ in range(groups):
            row = self.rng.choice(self.rows)
            group_id = f"{self.policy}-r{self.index}-g{self.stats.groups_started}"
            self.stats.groups_started += 1
            open_groups[group_id] = _OpenGroup(row, [None] * self.rl.group_size)
            batch.add([row["prompt"]] * self.rl.group_size, keys=[(group_id, i) for i in range(self.rl.group_size)])

    def _close_groups(self, open_groups: Dict[str, _OpenGroup],
                      finished: List[Tuple[Hashable, Completion]]) -> List[Sample]:
        """Record finished completions; the samples of every group now complete."""
        closed = []
        for (group_id, i), completion in finished:
            group = open_groups[group_id]
            group.completions[i] = completion
            if all(c is not None for c in group.completions):
                closed.append((group_id, open_groups.pop(group_id)))
        if not closed:
            return []
        samples, now = [], time.time()
        for group_id, group in closed:
            samples += [Sample(sample_id=f"{group_id}/{i}", group_id=group_id, policy=self.policy,
                               prompt=group.row["prompt"], completion=c.text, prompt_ids=c.prompt_ids,
                               completion_ids=c.completion_ids, behaviour_logprobs=c.logprobs,
                               token_versions=c.versions, row=dict(group.row), created_at=now)
                        for i, c in enumerate(group.completions)]
        tokens = sum(len(s.completion_ids) for s in samples)
        self.stats.groups_generated += len(closed)
        self.stats.samples_generated += len(samples)
        self.stats.tokens_generated += tokens
        self.stats.busy_s += self._unreported_busy_s
        self.queue.add_counters(self.keys.rollout_stats, busy_s=self._unreported_busy_s, samples=len(samples),
                                tokens=tokens)
        self._unreported_busy_s = 0.0
        return samples

    def evaluate_snapshot(self, snapshot: Dict, rows: List[Dict], max_new_tokens: int, batch_size: int) -> float:
        """Greedy accuracy of weights not published as a version (SFT in progress). They are held
        as version -1, so the first published version replaces them."""
        self.engine.load_weights(from_snapshot(snapshot), -1)
        return self.evaluate(rows, max_new_tokens, batch_size)

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
