"""The reward worker: reads samples from a job's reward queue, scores them, stores the results.

Runs as a Ray actor inside a job (`RewardActor`) or as a standalone process on any machine
that reaches Redis (`rlp reward-worker`), looping until the job's stop flag is set. Delivery
is at least once: results are stored idempotently by sample id and acknowledged in the same
step; requests a dead worker held are reclaimed after `claim_idle_s`, and a request delivered
`max_deliveries` times without a result, or one that cannot be decoded, goes to dead letters.
Each round of its loop beats on the job's heartbeat hash, so a worker that stops making progress
is named like a silent rollout worker.
That loop is `QueueWorker` (`rlplatform.transport.queue_worker`), which the tool worker runs as well.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from typing import List, Optional, Tuple

from rlplatform.actor_classes import LazyActorClass
from rlplatform.config import RewardSpec, RewardWorkersConfig
from rlplatform.rewards.registry import resolve
from rlplatform.rewards.scoring import Scorer
from rlplatform.transport.deadlines import REWARD_WORKER, Heartbeats
from rlplatform.transport.queue_worker import QueueStats, QueueWorker
from rlplatform.transport.redis_server import RECONNECT_S, connect
from rlplatform.transport.reward_queue import RewardQueue
from rlplatform.transport.samples import Sample, ScoredSample, decode_sample
from rlplatform.user_code import import_modules


@dataclass
class RewardStats(QueueStats):
    scored: int = 0
    errors: int = 0


def job_rewards_json(rewards: List[RewardSpec], imports: List[str]) -> str:
    return json.dumps({"imports": list(imports), "rewards": [asdict(r) for r in rewards]})


def job_rewards_from_json(text: str) -> Tuple[List[RewardSpec], List[str]]:
    body = json.loads(text)
    return [RewardSpec(**r) for r in body["rewards"]], body["imports"]


class RewardWorker(QueueWorker):
    def __init__(self, name: str, rewards: List[RewardSpec], redis_url: str, run: str,
                 config: Optional[RewardWorkersConfig] = None, *, imports: Optional[List[str]] = None) -> None:
        """`run`: the `run_scope` of the run it serves."""
        config = config or RewardWorkersConfig()
        import_modules(imports or [])
        self.scorer = Scorer(resolve(rewards), config.concurrency)
        queue = RewardQueue(connect(redis_url, wait_s=RECONNECT_S), run)  # a restart may meet Redis restarting
        super().__init__(name, queue, queue, config, RewardStats(), heartbeats=Heartbeats(queue.client, run),
                         label=REWARD_WORKER + name, round_limit_s=max(spec.timeout_s for spec in rewards))

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
        self.run_queue.add_counters(self.run_queue.keys.reward_stats, busy_s=time.perf_counter() - start,
                                    scored=len(scored), latency_s=latency)
        return scored

    def store(self, msg_ids: List[str], results: List[ScoredSample]) -> None:
        """Each result whole under its sample id and its metadata on the results stream (`store_results`)."""
        self.run_queue.store_results(list(zip(msg_ids, results)))


def default_worker_name(job: str) -> str:
    return f"{job}-reward-{socket.gethostname()}-{os.getpid()}"


RewardActor = LazyActorClass(RewardWorker)
