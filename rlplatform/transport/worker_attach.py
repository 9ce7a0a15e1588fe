"""Rollout workers attached to a running job by name: the request, its lease and the job's answer, on Redis.

`rlp rollout-worker --job NAME`, run on a node of the job's Ray cluster, adds an `AttachRequest` to the run's
stream (`JobKeys.attach_requests`) and holds a lease on it (`AttachLease`) while it runs. The job reads new
requests in its RL loop (`AttachRequests`), starts the workers on that node and answers; once the lease lapses
(the command ended, or its machine went away) the job stops them and issues the groups they had not submitted
again (`rlplatform.job.elastic`).
"""

from __future__ import annotations

import uuid
from typing import List, Optional, Tuple

import redis

from rlplatform.transport.keys import JobKeys
from rlplatform.transport.samples import WireFormatError
from rlplatform.transport.side_channels import AttachAnswer, AttachRequest

LEASE_S = 10.0  # a request's lease lapses this long after its command's last renewal
ANSWER_KEPT_S = 3600.0


class AttachLease:
    """The command's end: one request, renewed while the command runs, released when it ends."""

    def __init__(self, client: redis.Redis, keys: JobKeys, request: AttachRequest) -> None:
        self.client, self.keys, self.request = client, keys, request

    @classmethod
    def ask(cls, client: redis.Redis, keys: JobKeys, *, policy: str, node_id: str, node_ip: str,
            workers: int) -> "AttachLease":
        """Take a lease and ask the job for `workers` rollout workers on the node `node_id` (or at `node_ip`)."""
        lease = cls(client, keys, AttachRequest(uuid.uuid4().hex[:12], policy, node_id, node_ip, workers))
        client.set(keys.attach_lease(lease.request.request), 1, px=round(LEASE_S * 1000))
        client.xadd(keys.attach_requests, lease.request.fields())
        return lease

    def renew(self) -> bool:
        """Keep the lease; False once it has lapsed (not renewed for `LEASE_S`), the job then having stopped the
        workers: a lapsed lease is not taken back."""
        return bool(self.client.set(self.keys.attach_lease(self.request.request), 1, px=round(LEASE_S * 1000),
                                    xx=True))

    def answer(self) -> Optional[AttachAnswer]:
        """The job's answer, once it has given one."""
        fields = self.client.hgetall(self.keys.attach_answer(self.request.request))
        return AttachAnswer.of(fields) if fields else None

    def release(self) -> None:
        """The command ends: the job stops the workers it started for this request."""
        self.client.delete(self.keys.attach_lease(self.request.request))


class AttachRequests:
    """The job's end: the requests made since the last look, their answers and whether each is still held."""

    def __init__(self, client: redis.Redis, keys: JobKeys) -> None:
        self.client, self.keys = client, keys
        self._seen = "0-0"  # requests made before the RL loop began (during SFT) are read on its first look

    def new(self) -> Tuple[List[AttachRequest], List[str]]:
        """(the requests added since the last call, one line for each entry that is not a request)."""
        reply = self.client.xread({self.keys.attach_requests: self._seen})
        if not reply:
            return [], []
        entries = reply[0][1]
        self._seen = entries[-1][0]
        requests, malformed = [], []
        for entry_id, fields in entries:
            try:
                requests.append(AttachRequest.of(fields))
            except WireFormatError as err:  # no request id to answer: the job's log says it
                malformed.append(f"attach request {entry_id.decode()} passed over: {err}")
        return requests, malformed

    def answer(self, request: AttachRequest, answer: AttachAnswer) -> None:
        key = self.keys.attach_answer(request.request)
        self.client.pipeline(transaction=False).hset(key, mapping=answer.fields()) \
            .expire(key, round(ANSWER_KEPT_S)).execute()

    def held(self, request: AttachRequest) -> bool:
        """Whether the command that made `request` still runs (renews its lease)."""
        return bool(self.client.exists(self.keys.attach_lease(request.request)))
