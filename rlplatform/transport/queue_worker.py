"""The delivery loop of every queue service (the reward worker, the tool worker): requests read from
a Redis stream with at-least-once delivery, results stored idempotently and acknowledged in the same
step, requests a dead worker held taken back, and a request that cannot be decoded or was delivered
too often dead-lettered. Each round beats on the job's heartbeat hash.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List, Tuple

from rlplatform.config import RewardWorkersConfig
from rlplatform.priority import set_cpu_priority
from rlplatform.transport.deadlines import Heartbeats
from rlplatform.transport.reward_queue import RewardQueue
from rlplatform.transport.stream_queue import StreamQueue
from rlplatform.transport.samples import WireFormatError


@dataclass
class QueueStats:
    """What `QueueWorker`'s loop counts for any queue service."""
    dead_letters: int = 0
    reclaimed: int = 0
    busy_s: float = 0.0



class QueueWorker:
    """The delivery loop every queue service runs (`RewardWorker`, the tool worker): take back
    requests a dead worker held, fetch new ones, dead-letter what cannot be decoded or was
    delivered too often, `handle` the rest and store their results idempotently. Subclasses give
    `decode` and `handle`; `stats` (a `QueueStats`) counts `dead_letters` and `reclaimed` and time spent `busy_s`.
    `run_queue` is the run's reward queue: its stop flag ends `run`, its counters collect the figures;
    `label` names the worker on the job's heartbeat hash (`heartbeats`), as silent workers are named;
    `round_limit_s`: the longest one round may take by design (its calls' timeout), which its beats state."""

    def __init__(self, name: str, queue: StreamQueue, run_queue: RewardQueue, config: RewardWorkersConfig, stats,
                 *, heartbeats: Heartbeats, label: str, round_limit_s: float = 0.0) -> None:
        self.name, self.queue, self.run_queue, self.config, self.stats = name, queue, run_queue, config, stats
        self.heartbeats, self.label, self.round_limit_s = heartbeats, label, round_limit_s
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
            while not self.run_queue.stop_requested():
                self.heartbeats.beat(self.label, "serving", round_limit_s=self.round_limit_s)
                self.step()
        finally:
            self.heartbeats.leave(self.label)
        return self.stats
