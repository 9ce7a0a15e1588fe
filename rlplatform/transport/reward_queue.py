"""The reward queue: rollout workers submit samples, reward workers score them (a `stream_queue.StreamQueue`).

`RewardQueue` is the reward service's queue: requests `rlp:<run>:requests` (consumer group
`reward-workers`), dead letters `rlp:<run>:dead`. Each new result is stored whole under its sample
id (`results.ResultStore`) and its small `ResultMeta` goes to `rlp:<run>:results`, in the same
atomic step: the controller reads the metadata in order, learner ranks read the samples themselves
by id. It also holds the run's shared flags and counters. A run's keys are scoped by `<job name>:<run
id>` (`keys.run_scope`), so a run touches the keys of no other run, of its name or another.
"""

from __future__ import annotations

from collections import Counter
from typing import Dict, List, Optional, Set, Tuple

import redis

from rlplatform.transport.keys import JobKeys
from rlplatform.transport.results import ResultStore
from rlplatform.transport.rollout_counters import add_to_counters, read_counters
from rlplatform.transport.samples import (ResultMeta, Sample, ScoredSample, WireFormatError, decode_meta, decode_sample,
                                          encode_meta, encode_sample, encode_scored)
from rlplatform.transport.side_channels import StepEnd
from rlplatform.transport.stream_queue import Claims, StreamQueue, entry_payloads

GROUP = "reward-workers"


class RewardQueue(StreamQueue):
    """Both ends of one run's reward queue, and the run's shared flags and counters."""

    def __init__(self, client: redis.Redis, run: str, max_pending: Optional[int] = None) -> None:
        """`run`: the run's `run_scope`. `max_pending`: the job's bound on unscored requests. The controller
        passes it and records it on Redis (`run_keys.start_run`); producers built without it read it there."""
        self.keys = JobKeys(run)
        super().__init__(client, self.keys.rewards_queue, GROUP, self.keys.max_pending, max_pending)
        self.results = ResultStore(client, self.keys)

    def submit(self, samples: List[Sample], counters: Optional[str] = None, poll_s: float = 0.01,
               claims: Optional[Claims] = None) -> None:
        """Append samples for scoring, within the job's bound (`submit_payloads`); with `counters`
        (`PolicyKeys.rollout_stats`) their number and model tokens are counted as they go in; with `claims`,
        their groups are released from their worker in the same step."""
        self.submit_payloads([encode_sample(sample) for sample in samples], poll_s, counters,
                             [sample.trained_tokens for sample in samples], claims)

    def store_results(self, done: List[Tuple[str, ScoredSample]]) -> int:
        """Store (message id, result) pairs once per sample id, each whole under its id and its
        metadata on the results stream, and acknowledge them."""
        return self.store([(msg_id, scored.sample.sample_id, self.keys.results, encode_meta(ResultMeta.of(scored)))
                           for msg_id, scored in done],
                          [(self.keys.result(scored.sample.sample_id), encode_scored(scored))
                           for _, scored in done])

    def read_results(self, count: int = 1024, block_ms: Optional[int] = 100) -> List[ResultMeta]:
        """The metadata of results not read before, oldest first; read entries are trimmed from the
        stream (the results themselves stay in `self.results` until deleted)."""
        return self._decoded(self.read(self.keys.results, count, block_ms))

    def await_results(self, block_ms: int, count: int = 1024) -> Tuple[List[ResultMeta], Set[str]]:
        """`read_results`, waiting at most `block_ms` for new results or a learner step's end (`announce_step_end`),
        whichever comes first: (the results, the policies whose learner announced a step's end)."""
        found = self._read_streams([self.keys.results, self.keys.learner_steps], count, block_ms)
        return self._decoded(entry_payloads(found.get(self.keys.results, []))), self._step_ends(
            found.get(self.keys.learner_steps, []))

    def _step_ends(self, entries: List[Tuple[bytes, Dict[bytes, bytes]]]) -> Set[str]:
        """The policies of the learner step ends read; an entry that is not one goes to the dead letters."""
        stepped = set()
        for msg_id, fields in entries:
            try:
                stepped.add(StepEnd.of(fields).policy)
            except WireFormatError as err:
                self.client.xadd(self.keys.dead, {**fields, "reason": str(err), "message_id": msg_id})
        return stepped

    def _decoded(self, entries: List[Tuple[str, bytes]]) -> List[ResultMeta]:
        """Each entry's metadata; one that does not decode goes to the dead letters, with the reason."""
        results = []
        for msg_id, raw in entries:
            try:
                results.append(decode_meta(raw))
            except WireFormatError as err:
                self.client.xadd(self.keys.dead, {"data": raw, "reason": str(err), "message_id": msg_id})
        return results

    def left_at_end(self) -> Tuple[List[ResultMeta], Counter]:
        """What a stage left untrained on Redis, read once its workers have stopped, to account for it: the
        metadata of every result not read before (trimmed, as `read_results`) and the samples never scored, by
        policy (requests still in the stream, held by a worker or not yet read, and dead letters). One atomic
        read: a reward worker the job does not wait for (one started outside it) may still store a result, moving
        its sample from the requests to the results, and two reads would see it in neither."""
        pipe = self.client.pipeline(transaction=True)
        pipe.xread(self._unread([self.keys.results]))
        pipe.xrange(self.keys.requests)
        pipe.xrange(self.keys.dead)
        results, requests, dead = pipe.execute()
        unread = self._decoded(entry_payloads(self._took(results).get(self.keys.results, [])))
        unscored: Counter = Counter()
        for _, fields in requests + dead:
            try:
                unscored[decode_sample(fields.get(b"data", b"")).policy] += 1
            except WireFormatError:
                unscored["<undecodable>"] += 1
        return unread, unscored

    # job lifecycle
    def publish_rewards(self, specs_json: str) -> None:
        """The job's reward list (JSON) for reward workers started outside the job."""
        self.client.set(self.keys.rewards, specs_json)

    def request_stop(self, keep_s: int = 3600) -> None:
        """Tell every worker of the job to stop; the flag outlives the job for `keep_s`."""
        self.client.set(self.keys.stop, 1, ex=keep_s)

    def stop_requested(self) -> bool:
        return bool(self.client.exists(self.keys.stop))

    def add_counters(self, key: str, **values: float) -> None:
        """Add to a shared counter hash (`keys.reward_stats`, a tool or teacher workers' stats)."""
        add_to_counters(self.client, key, values)

    def counters(self, key: str) -> Dict[str, float]:
        return read_counters(self.client, key)


STEP_ENDS_KEPT = 64  # learner step ends kept on their stream (approximately) when nothing reads it


def announce_step_end(client: redis.Redis, run: str, policy: str, step: int) -> None:
    """Say that `policy`'s learner has ended RL step `step`: the RL loop, waiting for results (`await_results`),
    wakes at once to record the step and start the next."""
    client.xadd(JobKeys(run).learner_steps, StepEnd(policy, step).fields(), maxlen=STEP_ENDS_KEPT, approximate=True)
