"""The reward worker: reads samples from a job's reward queue, scores them, stores the results.

Runs as a Ray actor inside a job (`RewardActor`) or as a standalone process on any machine
that reaches Redis (`rlp reward-worker`), looping until the job's stop flag is set. Delivery
is at least once: results are stored idempotently by sample id and acknowledged in the same
step; requests a dead worker held are reclaimed after `claim_idle_s`, and a request delivered
`max_deliveries` times without a result, or one that cannot be decoded, goes to dead letters.
Each round of its loop beats on the job's heartbeat hash, so a worker that stops making progress
is named like a silent rollout worker.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import List, Optional, Tuple

import ray

from rlplatform.config import RewardSpec, RewardWorkersConfig
from rlplatform.rewards.registry import importable_from_cwd, resolve
from rlplatform.rewards.scoring import Scorer
from rlplatform.transport.deadlines import Heartbeats
from rlplatform.transport.redis_server import connect
from rlplatform.transport.reward_queue import RewardQueue
from rlplatform.transport.samples import Sample, WireFormatError


@dataclass
class RewardStats:
    scored: int = 0
    errors: int = 0
    dead_letters: int = 0
    reclaimed: int = 0
    busy_s: float = 0.0


def import_modules(modules: List[str]) -> None:
    """Import the job's `imports` so rewards they register with @rlplatform.reward exist here."""
    importable_from_cwd()
    for module in modules:
        importlib.import_module(module)


def job_rewards_json(rewards: List[RewardSpec], imports: List[str]) -> str:
    return json.dumps({"imports": list(imports), "rewards": [asdict(r) for r in rewards]})


def job_rewards_from_json(text: str) -> Tuple[List[RewardSpec], List[str]]:
    body = json.loads(text)
    return [RewardSpec(**r) for r in body["rewards"]], body["imports"]


class RewardWorker:
    def __init__(self, name: str, rewards: List[RewardSpec], redis_url: str, job: str,
                 config: Optional[RewardWorkersConfig] = None, imports: Optional[List[str]] = None) -> None:
        self.name = name
        self.config = config or RewardWorkersConfig()
        import_modules(imports or [])
        self.scorer = Scorer(resolve(rewards), self.config.concurrency)
        self.queue = RewardQueue(connect(redis_url), job)
        self.queue.create_group()
        self.heartbeats = Heartbeats(self.queue.client, job)
        self.label = f"reward worker {name}"  # as silent workers are named
        self.stats = RewardStats()
        self._last_reclaim = 0.0
        self._recovered = False  # requests an earlier process of this name held are taken back first

    def step(self, block_ms: int = 100) -> int:
        """Score one batch from the queue; returns how many messages were handled."""
        messages = self._reclaim() + [(m, raw, 0) for m, raw in
                                      self.queue.fetch(self.name, self.config.batch_size, block_ms)]
        start = time.perf_counter()
        ids, samples = [], []
        for msg_id, raw, delivered in messages:
            sample = self._decode_or_dead_letter(msg_id, raw, delivered)
            if sample is not None:
                ids.append(msg_id)
                samples.append(sample)
        done = list(zip(ids, self.scorer.score(samples))) if samples else []
        now = time.time()
        for _, scored in done:
            scored.scored_at = now
            self.stats.errors += scored.error is not None
        self.queue.store_results(done)
        self.stats.scored += len(done)
        if messages:
            busy = time.perf_counter() - start
            self.stats.busy_s += busy
            latency = sum(s.scored_at - s.sample.created_at for _, s in done)
            self.queue.add_counters(self.queue.keys.reward_stats, busy_s=busy, scored=len(done), latency_s=latency)
        return len(messages)

    def _decode_or_dead_letter(self, msg_id: str, raw: bytes, delivered: int) -> Optional[Sample]:
        if delivered >= self.config.max_deliveries:
            self.queue.dead_letter(msg_id, raw, f"delivered {delivered} times without a stored result")
            self.stats.dead_letters += 1
            return None
        try:
            return self.queue.decode(raw)
        except WireFormatError as err:
            self.queue.dead_letter(msg_id, raw, str(err))
            self.stats.dead_letters += 1
            return None

    def _reclaim(self) -> List[Tuple[str, bytes, int]]:
        """Every half idle period: take over requests that a dead worker left unacknowledged; at the
        first step, also at once those this worker's name held before a restart."""
        taken = []
        if not self._recovered:
            self._recovered = True
            taken = self.queue.reclaim(self.name, 0, self.config.batch_size, owner=self.name)
        now = time.monotonic()
        if now - self._last_reclaim >= self.config.claim_idle_s / 2:
            self._last_reclaim = now
            taken += self.queue.reclaim(self.name, int(self.config.claim_idle_s * 1000),
                                        self.config.batch_size - len(taken))
        self.stats.reclaimed += len(taken)
        return taken

    def run(self) -> RewardStats:
        """Score until the job's stop flag is set, beating on the heartbeat hash each round."""
        try:
            while not self.queue.stop_requested():
                self.heartbeats.beat(self.label)
                self.step()
        finally:
            self.heartbeats.leave(self.label)
        return self.stats


def default_worker_name(job: str) -> str:
    return f"{job}-reward-{socket.gethostname()}-{os.getpid()}"


RewardActor = ray.remote(RewardWorker)
