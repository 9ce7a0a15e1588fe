"""At-least-once work queues on Redis Streams, the machinery every slow service of a job shares (rewards in
`reward_queue`, tool calls in `tool_queue`, a distilling policy's teacher scoring in `teacher_queue`).

Requests go to a stream read through a consumer group (at-least-once). A worker stores each result with one Lua
script that records the result's id, appends the result to the result stream its request names only the first
time that id is seen (idempotent), then acknowledges and deletes the request. Requests a dead worker held are
reclaimed; messages that cannot be decoded go to a dead-letter stream with the reason. Producers append only
while the requests stream stays within the job's bound (recorded on Redis by the controller), and otherwise
wait: backpressure, never dropping. A queue's keys are named by `keys.QueueKeys`.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

import redis

from rlplatform.transport.keys import QueueKeys
from rlplatform.transport.rollout_counters import SUBMITTED

# KEYS: done-ids set, requests stream, then the result stream of each entry. ARGV: group, then
# (message id, result id, stream payload, stash key, stash value) quintuples: a new result appends its
# payload to its stream and, when the stash key is not empty, stores the stash value under it.
# Returns how many results were new.
_STORE_RESULTS = """
local added = 0
for i = 2, #ARGV, 5 do
  if redis.call('SADD', KEYS[1], ARGV[i + 1]) == 1 then
    if ARGV[i + 3] ~= '' then
      redis.call('SET', ARGV[i + 3], ARGV[i + 4])
    end
    redis.call('XADD', KEYS[2 + (i + 3) / 5], '*', 'data', ARGV[i + 2])
    added = added + 1
  end
  redis.call('XACK', KEYS[2], ARGV[1], ARGV[i])
  redis.call('XDEL', KEYS[2], ARGV[i])
end
return added
"""


# KEYS: requests stream, then the producer's rollout counters (`rollout_counters`) when ARGV[3] is '1', then a
# prompt ledger's claims when there are claims to release. ARGV: the bound, the payloads' completion tokens, '1' to
# count, the number n of claims to release, n group ids, then payloads. Appends the payloads only when the stream
# stays within the bound (one atomic step, so producers together never exceed it) and, in the same step, adds them
# to the counters' requests and tokens (the fields `SUBMITTED` names) and releases the claims; returns 1 when
# appended, 0 when the caller must wait. Only the keys it touches are named: a job's Redis user reaches no others.
_SUBMIT_WITHIN_BOUND = """
local first = 5 + tonumber(ARGV[4])
if redis.call('XLEN', KEYS[1]) + #ARGV - first + 1 > tonumber(ARGV[1]) then
  return 0
end
for i = first, #ARGV do
  redis.call('XADD', KEYS[1], '*', 'data', ARGV[i])
end
if ARGV[3] == '1' then
  redis.call('HINCRBYFLOAT', KEYS[2], '%s', #ARGV - first + 1)
  redis.call('HINCRBYFLOAT', KEYS[2], '%s', ARGV[2])
end
for i = 5, first - 1 do
  redis.call('HDEL', KEYS[#KEYS], ARGV[i])
end
return 1
""" % SUBMITTED

DEFAULT_MAX_PENDING = 10000  # the producer bound when the job recorded none (redis.max_stream_len's default)
Claims = Tuple[str, List[str]]  # a prompt ledger's claims hash and the group ids a submit releases from it



class StreamQueue:
    """Both ends of one at-least-once work queue: `requests` read through consumer group `group`,
    results stored once per result id (remembered in `done_ids`), undecodable or undeliverable
    requests moved to `dead`. Payloads are bytes; what they encode is the subclass's business."""

    def __init__(self, client: redis.Redis, queue: QueueKeys, group: str, bound_key: str,
                 max_pending: Optional[int] = None) -> None:
        """`queue`: the queue's keys; `bound_key`: where the job records its bound on pending requests, read when
        `max_pending` is None."""
        self.client = client
        self.requests, self.done_ids, self.dead, self.group = queue.requests, queue.done_ids, queue.dead, group
        self.bound_key, self.max_pending = bound_key, max_pending
        self._store = client.register_script(_STORE_RESULTS)
        self._submit = client.register_script(_SUBMIT_WITHIN_BOUND)
        self._last_read: Dict[str, str] = {}  # result stream -> id of the newest entry read

    def create_group(self) -> None:
        try:
            self.client.xgroup_create(self.requests, self.group, id="0", mkstream=True)
        except redis.ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise

    # producer side
    def submit_payloads(self, payloads: List[bytes], poll_s: float = 0.01, counters: Optional[str] = None,
                        tokens: Optional[List[int]] = None, claims: Optional[Claims] = None) -> None:
        """Append requests, waiting while they would take the stream past the job's bound of pending
        requests (backpressure: nothing is dropped); a batch larger than the bound goes in parts.
        With `counters` (a policy's rollout counters), each part appended adds its requests to `samples` and
        their tokens to `tokens` in the same atomic step, so the counts equal what the stream received
        even when the producer dies midway. With `claims` (a prompt ledger's claims hash, group ids), the groups
        are released from their worker in the step that appends the last part: a worker that dies right after
        its submit never has them abandoned (their prompts issued again) as well as trained."""
        bound = self.bound()
        keys = [self.requests] + ([counters] if counters else [])
        tokens = tokens or [0] * len(payloads)
        for start in range(0, len(payloads), bound):
            part = payloads[start:start + bound]
            released = list(claims[1]) if claims and start + bound >= len(payloads) else []
            args = [bound, sum(tokens[start:start + bound]), int(bool(counters)), len(released), *released, *part]
            while not self._submit(keys=keys + ([claims[0]] if released else []), args=args):
                time.sleep(poll_s)

    def bound(self) -> int:
        """Pending requests the stream may hold: given, else the job's recorded bound."""
        if self.max_pending is None:
            recorded = self.client.get(self.bound_key)
            self.max_pending = int(recorded) if recorded is not None else DEFAULT_MAX_PENDING
        return self.max_pending

    # consumer side (workers)
    def fetch(self, consumer: str, count: int, block_ms: int) -> List[Tuple[str, bytes]]:
        """Up to `count` new requests for `consumer` as (message id, raw payload)."""
        reply = self.client.xreadgroup(self.group, consumer, {self.requests: ">"}, count=count, block=block_ms)
        if not reply:
            return []
        return [(as_text(msg_id), fields.get(b"data", b"")) for msg_id, fields in reply[0][1]]

    def store(self, done: List[Tuple[str, str, str, bytes]],
              stashes: Optional[List[Tuple[str, bytes]]] = None) -> int:
        """Store (message id, result id, result stream, payload) once per result id and acknowledge
        the requests; with `stashes`, a new result also stores its (key, value) pair. Returns how
        many results were new."""
        if not done:
            return 0
        stashes = stashes or [("", b"")] * len(done)
        args: list = [self.group]
        for (msg_id, result_id, _, payload), (key, value) in zip(done, stashes):
            args += [msg_id, result_id, payload, key, value]
        keys = [self.done_ids, self.requests] + [stream for _, _, stream, _ in done]
        return int(self._store(keys=keys, args=args))

    def dead_letter(self, msg_id: str, raw: bytes, reason: str) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(self.dead, {"data": raw, "reason": reason, "message_id": msg_id})
        pipe.xack(self.requests, self.group, msg_id)
        pipe.xdel(self.requests, msg_id)
        pipe.execute()

    def reclaim(self, consumer: str, min_idle_ms: int, count: int,
                owner: Optional[str] = None) -> List[Tuple[str, bytes, int]]:
        """Take over requests another consumer (or `owner` alone: a worker restarted under the same
        name) has held unacknowledged for `min_idle_ms` (it died or hangs): (message id, payload,
        times delivered before) for each."""
        pending = self.client.xpending_range(self.requests, self.group, min="-", max="+", count=count,
                                             consumername=owner, idle=min_idle_ms)
        if not pending:
            return []
        deliveries = {as_text(p["message_id"]): int(p["times_delivered"]) for p in pending}
        claimed = self.client.xclaim(self.requests, self.group, consumer, min_idle_ms, list(deliveries))
        taken = []
        for msg_id, fields in claimed:
            if fields is None:  # deleted meanwhile: already handled and stored
                continue
            taken.append((as_text(msg_id), fields.get(b"data", b""), deliveries[as_text(msg_id)]))
        return taken

    # results side
    def read(self, stream: str, count: int = 1024, block_ms: Optional[int] = 100) -> List[Tuple[str, bytes]]:
        """(entry id, payload) of results on `stream` not read before, oldest first; read entries are trimmed."""
        return entry_payloads(self._read_streams([stream], count, block_ms).get(stream, []))

    def _read_streams(self, streams: List[str], count: int,
                      block_ms: Optional[int]) -> Dict[str, List[Tuple[str, Dict[bytes, bytes]]]]:
        """Entries not read before on any of `streams` (one call, blocking until one has some), by stream, oldest
        first; read entries are trimmed."""
        reply = self.client.xread(self._unread(streams), count=count, block=block_ms)
        return self._took(reply)

    def _unread(self, streams: List[str]) -> Dict[str, str]:
        """Each stream with the id of its newest entry read: XREAD's argument for the entries after it."""
        return {stream: self._last_read.get(stream, "0-0") for stream in streams}

    def _took(self, reply) -> Dict[str, List[Tuple[str, Dict[bytes, bytes]]]]:
        """An XREAD reply's entries by stream, recorded as read and trimmed from their streams."""
        found, trims = {}, self.client.pipeline(transaction=False)
        for stream, entries in reply or []:
            stream = as_text(stream)
            self._last_read[stream] = as_text(entries[-1][0])
            trims.xtrim(stream, minid=self._last_read[stream], approximate=False)
            found[stream] = [(as_text(msg_id), fields) for msg_id, fields in entries]
        if found:
            trims.execute()  # every stream read, in one round trip
        return found

    def pending(self) -> int:
        """Requests submitted and not yet handled."""
        return int(self.client.xlen(self.requests))

    def dead_letters(self) -> int:
        return int(self.client.xlen(self.dead))


def entry_payloads(entries: List[Tuple[str, Dict[bytes, bytes]]]) -> List[Tuple[str, bytes]]:
    """(entry id, its `data` field) of each stream entry (empty bytes where it has none)."""
    return [(msg_id, fields.get(b"data", b"")) for msg_id, fields in entries]


def as_text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
