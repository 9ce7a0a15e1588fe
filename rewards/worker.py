"""The reward worker: reads samples from a job's reward queue, scores them, stores the results.

Runs as a Ray actor inside a job (`RewardActor`) or as a standalone process on any machine
that reaches Redis (`rlp reward-worker`), looping until the job's stop flag is set. Delivery
is at least once: results are stored idempotently by sample id and acknowledged in the same
step; requests a dead worker held are reclaimed after `claim_idle_s`, and a request delivered
`max_deliveries` times without a result, or one that cannot be decoded, goes to dead letters.
Each round of its loop beats on the job's heartbeat hash, so a worker that stops making progress
is named like a silent rollout worker.
That loop is `QueueWorker`, which the tool worker (`rlplatform.envs.tool_worker`) runs as well.
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
from rlplatform.priority import set_cpu_priority
from rlplatform.rewards.registry import importable_from_cwd, resolve
from rlplatform.rewards.scoring import Scorer
from rlplatform.transport.deadlines import Heartbeats
from rlplatform.transport.redis_server import RECONNECT_S, connect
from rlplatform.transport.reward_queue import RewardQueue, StreamQueue
from rlplatform.transport.samples import Sample, ScoredSample, WireFormatError, decode_sample


@dataclass
class QueueStats:
    """What `QueueWorker`'s loop counts for any queue service."""
    dead_letters: int = 0
    reclaimed: int = 0
    busy_s: float = 0.0


@dataclass
class RewardStats(QueueStats):
    scored: int = 0
    errors: int = 0


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


class QueueWorker:
    """The delivery loop every queue service runs (`RewardWorker`, the tool worker): take back
    requests a dead worker held, fetch new ones, dead-letter what cannot be decoded or was
    delivered too often, `handle` the rest and store their results idempotently. Subclasses give
    `decode` and `handle`; `stats` (a `QueueStats`) counts `dead_letters` and `reclaimed` and time spent `busy_s`.
    `job` is the job's reward queue: its stop flag ends `run`, its counters collect the figures;
    `label` names the worker on the job's heartbeat hash (`heartbeats`), as silent workers are named."""

    def __init__(self, name: str, queue: StreamQueue, job: RewardQueue, config: RewardWorkersConfig, stats,
                 heartbeats: Heartbeats, label: str) -> None:
        self.name, self.queue, self.job, self.config, self.stats = name, queue, job, config, stats
        self.heartbeats, self.label = heartbeats, label
        set_cpu_priority(config.priority)
        self.queue.create_group()
        self._last_reclaim = 0.0
        self._recovered = False  # requests an earlier process of this name held are taken back first

    def decode(self, raw: bytes):
        """The request a payload holds; raises WireFormatError for a malformed one."""
        raise NotImplementedError

    def handle(self, requests: List) -> List:
        """The result of each request, in order, as `store` takes them (by default (result id, result
        stream, payload)); never raises for a request's fault."""
        raise NotImplementedError

    def store(self, msg_ids: List[str], results: List) -> None:
        """Store what `handle` made of the requests `msg_ids` and acknowledge them."""
        self.queue.store([(msg_id, *result) for msg_id, result in zip(msg_ids, results)])

    def step(self, block_ms: int = 100) -> int:
        """Handle one batch from the queue; returns how many messages were handled."""
        messages = self._reclaim() + [(m, raw, 0) for m, raw in
                                      self.queue.fetch(self.name, self.config.batch_size, block_ms)]
        start = time.perf_counter()
        ids, requests = [], []
        for msg_id, raw, delivered in messages:
            request = self._decode_or_dead_letter(msg_id, raw, delivered)
            if request is not None:
                ids.append(msg_id)
                requests.append(request)
        self.store(ids, self.handle(requests) if requests else [])
        if messages:
            self.stats.busy_s += time.perf_counter() - start
        return len(messages)

    def _decode_or_dead_letter(self, msg_id: str, raw: bytes, delivered: int):
        if delivered >= self.config.max_deliveries:
            self.queue.dead_letter(msg_id, raw, f"delivered {delivered} times without a stored result")
            self.stats.dead_letters += 1
            return None
        try:
            return self.decode(raw)
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

    def run(self):
        """Serve until the job's stop flag is set, beating on the job's heartbeat hash each round;
        returns the stats."""
        try:
            while not self.job.stop_requested():
                self.heartbeats.beat(self.label)
                self.step()
        finally:
            self.heartbeats.leave(self.label)
        return self.stats


class RewardWorker(QueueWorker):
    def __init__(self, name: str, rewards: List[RewardSpec], redis_url: str, job: str,
                 config: Optional[RewardWorkersConfig] = None, imports: Optional[List[str]] = None) -> None:
        config = config or RewardWorkersConfig()
        import_modules(imports or [])
        self.scorer = Scorer(resolve(rewards), config.concurrency)
        queue = RewardQueue(connect(redis_url, wait_s=RECONNECT_S), job)  # a restart may meet Redis restarting
        super().__init__(name, queue, queue, config, RewardStats(), Heartbeats(queue.client, job),
                         f"reward worker {name}")

    def decode(self, raw: bytes) -> Sample:
        return decode_sample(raw)

    def handle(self, samples: List[Sample]) -> List[ScoredSample]:
        start = time.perf_counter()
        scored = self.scorer.score(samples)
        now = time.time()
        for result in scored:
            result.scored_at = now
            self.stats.errors += result.error is not None
        self.stats.scored += len(scored)
        latency = sum(s.scored_at - s.sample.created_at for s in scored)
        self.job.add_counters(self.job.keys.reward_stats, busy_s=time.perf_counter() - start, scored=len(scored),
                              latency_s=latency)
        return scored

    def store(self, msg_ids: List[str], results: List[ScoredSample]) -> None:
        """Each result whole under its sample id and its metadata on the results stream (`store_results`)."""
        self.job.store_results(list(zip(msg_ids, results)))


def default_worker_name(job: str) -> str:
    return f"{job}-reward-{socket.gethostname()}-{os.getpid()}"


RewardActor = ray.remote(RewardWorker)
