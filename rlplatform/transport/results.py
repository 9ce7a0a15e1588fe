"""Scored samples held on Redis by sample id, between the reward workers and the learner ranks.

A reward worker stores each whole result under `rlp:<run>:result:<sample id>` (`JobKeys.result`) and puts only
its `ResultMeta` on the results stream (the reward queue's store script). Learner ranks fetch the
samples of their shard of a batch here, in one pipelined round trip; the controller deletes them
once trained or dropped, so Redis holds only results still waiting to be trained.
"""

from __future__ import annotations

from typing import Iterable, List

import redis

from rlplatform.transport.keys import JobKeys
from rlplatform.transport.samples import Sample, decode_scored

DELETE_CHUNK = 1000  # keys per UNLINK call


class ResultStore:
    def __init__(self, client: redis.Redis, keys: JobKeys) -> None:
        """`keys`: the run's keys (`JobKeys.result` names each sample's)."""
        self.client, self.key = client, keys.result

    def fetch(self, sample_ids: List[str]) -> List[Sample]:
        """The stored samples of `sample_ids`, in order, read in one pipelined round trip."""
        pipe = self.client.pipeline(transaction=False)
        for sample_id in sample_ids:
            pipe.get(self.key(sample_id))
        payloads = pipe.execute()
        missing = [i for i, payload in zip(sample_ids, payloads) if payload is None]
        if missing:
            raise LookupError(f"{len(missing)} scored samples (first: '{missing[0]}') are not on Redis under "
                              f"{self.key('*')}: they were deleted before being trained; was the job's Redis "
                              f"reset or flushed while it ran?")
        return [decode_scored(payload).sample for payload in payloads]

    def delete(self, sample_ids: Iterable[str]) -> None:
        """Forget these results: trained, or dropped for good."""
        keys = [self.key(sample_id) for sample_id in sample_ids]
        for start in range(0, len(keys), DELETE_CHUNK):
            self.client.unlink(*keys[start:start + DELETE_CHUNK])

    def held(self) -> int:
        """Results stored and not yet deleted."""
        return sum(1 for _ in self.client.scan_iter(match=self.key("*"), count=1000))
