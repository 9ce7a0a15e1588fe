"""The teacher queue of a distilling policy: its rollout workers submit samples here instead of to the reward
queue, a teacher scoring worker adds each completion token's log-prob under the teacher's newest weights, and the
sample goes on to the reward queue.

It is the reward queue's machinery (`StreamQueue`): requests `rlp:<run>:policy:<student>:teacher:requests` read
through consumer group `teacher-workers` (at-least-once, reclaimed from a dead worker, undecodable ones dead-lettered
to `...:teacher:dead`), within the job's bound of pending requests. A scored sample's "result" is the sample itself,
appended to the reward queue's requests stream in the same atomic step that acknowledges it, once per sample id.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import redis

from rlplatform.transport.keys import JobKeys, PolicyKeys
from rlplatform.transport.samples import Sample, encode_sample
from rlplatform.transport.stream_queue import Claims, StreamQueue

GROUP = "teacher-workers"


class TeacherQueue(StreamQueue):
    """Both ends of the teacher queue of `student`'s samples in run `run` (its `run_scope`)."""

    def __init__(self, client: redis.Redis, run: str, student: str) -> None:
        keys = JobKeys(run)
        super().__init__(client, PolicyKeys(run, student).teacher_queue, GROUP, keys.max_pending)
        self.reward_requests = keys.requests  # where scored samples go on

    def submit(self, samples: List[Sample], counters: Optional[str] = None, poll_s: float = 0.01,
               claims: Optional[Claims] = None) -> None:
        """Append samples for the teacher to score, within the job's bound; with `counters` (the student's
        `rollout_stats`) their number and model tokens are counted as they go in, as the reward queue counts; with
        `claims`, their groups are released from their worker in the same step."""
        self.submit_payloads([encode_sample(sample) for sample in samples], poll_s, counters,
                             [sample.trained_tokens for sample in samples], claims)

    def pass_on(self, done: List[Tuple[str, Sample]]) -> int:
        """Each (message id, sample scored by the teacher) onto the reward queue once per sample id, the requests
        acknowledged; returns how many were new."""
        return self.store([(msg_id, sample.sample_id, self.reward_requests, encode_sample(sample))
                           for msg_id, sample in done])
