"""Work queues on Redis Streams, and the reward queue: rollout workers submit samples, reward workers score them.

`StreamQueue` is the delivery machinery every slow service of a job shares (rewards here, tool
calls in `tool_queue`): requests go to a stream read through a consumer group (at-least-once).
A worker stores each result with one Lua script that records the result's id, appends the result
to the result stream its request names only the first time that id is seen (idempotent), then
acknowledges and deletes the request. Requests a dead worker held are reclaimed; messages that
cannot be decoded go to a dead-letter stream with the reason. Producers append only while the
requests stream stays within the job's bound (recorded on Redis by the controller), and
otherwise wait: backpressure, never dropping.

`RewardQueue` is the reward service's queue: requests `rlp:<run>:requests` (consumer group
`reward-workers`), dead letters `rlp:<run>:dead`. Each new result is stored whole under its sample
id (`results.ResultStore`) and its small `ResultMeta` goes to `rlp:<run>:results`, in the same
atomic step: the controller reads the metadata in order, learner ranks read the samples themselves
by id. It also holds the run's shared flags and counters. A run's keys are scoped by `<job name>:<run
id>` (`run_scope`), so a run touches the keys of no other run, of its name or another.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Dict, List, Optional, Set, Tuple

import redis

from rlplatform.transport.results import ResultStore
from rlplatform.transport.samples import (ResultMeta, Sample, ScoredSample, WireFormatError, decode_meta, decode_sample,
                                          encode_meta, encode_sample, encode_scored)

GROUP = "reward-workers"

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


# KEYS: requests stream, then optionally the producer's counter hash. ARGV: the bound, the
# payloads' completion tokens, then payloads. Appends them all only when the stream stays within
# the bound (one atomic step, so producers together never exceed it) and, in the same step, adds
# them to the counter hash's `samples` and `tokens`; returns 1 when appended, 0 when the caller must wait.
_SUBMIT_WITHIN_BOUND = """
if redis.call('XLEN', KEYS[1]) + #ARGV - 2 > tonumber(ARGV[1]) then
  return 0
end
for i = 3, #ARGV do
  redis.call('XADD', KEYS[1], '*', 'data', ARGV[i])
end
if KEYS[2] then
  redis.call('HINCRBYFLOAT', KEYS[2], 'samples', #ARGV - 2)
  redis.call('HINCRBYFLOAT', KEYS[2], 'tokens', ARGV[2])
end
return 1
"""

DEFAULT_MAX_PENDING = 10000  # the producer bound when the job recorded none (redis.max_stream_len's default)


def run_scope(job: str, run_id: str) -> str:
    """What one run's Redis keys are scoped by: `<job name>:<run id>` (`rlplatform.job.run_dir.run_id`)."""
    return f"{job}:{run_id}"


class JobKeys:
    """Names of one run's Redis keys shared by all its policies; `run` is its `run_scope`."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.prefix = f"rlp:{run}"
        self.requests = f"{self.prefix}:requests"
        self.results = f"{self.prefix}:results"  # the metadata of each new result
        self.result_prefix = f"{self.prefix}:result:"  # + sample id: the whole result, until trained or dropped
        self.scored_ids = f"{self.prefix}:scored-ids"
        self.dead = f"{self.prefix}:dead"
        self.stop = f"{self.prefix}:stop"
        self.reward_stats = f"{self.prefix}:reward-stats"  # counters summed over reward workers
        self.status = f"{self.prefix}:status"  # the job's live progress, read by `rlp status`
        self.rewards = f"{self.prefix}:rewards"  # the job's reward list, read by standalone reward workers
        self.max_pending = f"{self.prefix}:max-pending"  # the job's producer bound (redis.max_stream_len)
        self.heartbeats = f"{self.prefix}:heartbeats"  # worker label -> time its loop last went round
        self.learner_steps = f"{self.prefix}:learner-steps"  # a stream: the policy of each learner step as it ends


class PolicyKeys:
    """Names of one policy's Redis keys within its run (`run`: the run's `run_scope`)."""

    def __init__(self, run: str, policy: str) -> None:
        prefix = f"{JobKeys(run).prefix}:policy:{policy}"
        self.version = f"{prefix}:version"  # newest published weight version
        self.versions = f"{prefix}:versions"  # a stream announcing each published version (`versions`)
        self.groups_started = f"{prefix}:groups-started"
        self.groups_dropped = f"{prefix}:groups-dropped"
        self.rollout_stats = f"{prefix}:rollout-stats"  # the policy's rollout counters (the one record of them)
        self.canary_reference = f"{prefix}:canary-reference"  # the learner's parity canary scores (`parity_canary`)
        self.canary_checks = f"{prefix}:canary-checks"  # the engines' canary checks, a stream
        self.evaluator_process = f"{prefix}:evaluator-process"  # `this_process()` of the evaluator's newest process
        self.teacher_prefix = f"{prefix}:teacher"  # a distilling policy's teacher queue (`teacher_queue`)
        self.teacher_stats = f"{prefix}:teacher-stats"  # its teacher scoring workers' counters


class StreamQueue:
    """Both ends of one at-least-once work queue: `requests` read through consumer group `group`,
    results stored once per result id (remembered in `done_ids`), undecodable or undeliverable
    requests moved to `dead`. Payloads are bytes; what they encode is the subclass's business."""

    def __init__(self, client: redis.Redis, requests: str, done_ids: str, dead: str, group: str, bound_key: str,
                 max_pending: Optional[int] = None) -> None:
        """`bound_key`: where the job records its bound on pending requests, read when `max_pending` is None."""
        self.client = client
        self.requests, self.done_ids, self.dead, self.group = requests, done_ids, dead, group
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
                        tokens: Optional[List[int]] = None) -> None:
        """Append requests, waiting while they would take the stream past the job's bound of pending
        requests (backpressure: nothing is dropped); a batch larger than the bound goes in parts.
        With `counters` (a hash), each part appended adds its requests to `samples` and their
        `tokens` to `tokens` in the same atomic step, so the counts equal what the stream received
        even when the producer dies midway."""
        bound = self.bound()
        keys = [self.requests] + ([counters] if counters else [])
        tokens = tokens or [0] * len(payloads)
        for start in range(0, len(payloads), bound):
            part = payloads[start:start + bound]
            while not self._submit(keys=keys, args=[bound, sum(tokens[start:start + bound]), *part]):
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
        return [(_text(msg_id), fields.get(b"data", b"")) for msg_id, fields in reply[0][1]]

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
        deliveries = {_text(p["message_id"]): int(p["times_delivered"]) for p in pending}
        claimed = self.client.xclaim(self.requests, self.group, consumer, min_idle_ms, list(deliveries))
        taken = []
        for msg_id, fields in claimed:
            if fields is None:  # deleted meanwhile: already handled and stored
                continue
            taken.append((_text(msg_id), fields.get(b"data", b""), deliveries[_text(msg_id)]))
        return taken

    # results side
    def read(self, stream: str, count: int = 1024, block_ms: Optional[int] = 100) -> List[Tuple[str, bytes]]:
        """(entry id, payload) of results on `stream` not read before, oldest first; read entries are trimmed."""
        return _payloads(self._read_streams([stream], count, block_ms).get(stream, []))

    def _read_streams(self, streams: List[str], count: int,
                      block_ms: Optional[int]) -> Dict[str, List[Tuple[str, Dict[bytes, bytes]]]]:
        """Entries not read before on any of `streams` (one call, blocking until one has some), by stream, oldest
        first; read entries are trimmed."""
        reply = self.client.xread({stream: self._last_read.get(stream, "0-0") for stream in streams}, count=count,
                                  block=block_ms)
        found, trims = {}, self.client.pipeline(transaction=False)
        for stream, entries in reply or []:
            stream = _text(stream)
            self._last_read[stream] = _text(entries[-1][0])
            trims.xtrim(stream, minid=self._last_read[stream], approximate=False)
            found[stream] = [(_text(msg_id), fields) for msg_id, fields in entries]
        if found:
            trims.execute()  # every stream read, in one round trip
        return found

    def pending(self) -> int:
        """Requests submitted and not yet handled."""
        return int(self.client.xlen(self.requests))

    def dead_letters(self) -> int:
        return int(self.client.xlen(self.dead))


class RewardQueue(StreamQueue):
    """Both ends of one run's reward queue, and the run's shared flags and counters."""

    def __init__(self, client: redis.Redis, run: str, max_pending: Optional[int] = None) -> None:
        """`run`: the run's `run_scope`. `max_pending`: the job's bound on unscored requests. The controller
        passes it and `reset` records it on Redis; producers built without it read it from there."""
        self.keys = JobKeys(run)
        super().__init__(client, self.keys.requests, self.keys.scored_ids, self.keys.dead, GROUP,
                         self.keys.max_pending, max_pending)
        self.results = ResultStore(client, self.keys.result_prefix)

    def submit(self, samples: List[Sample], counters: Optional[str] = None, poll_s: float = 0.01) -> None:
        """Append samples for scoring, within the job's bound (`submit_payloads`); with `counters`
        (`PolicyKeys.rollout_stats`) their number and model tokens are counted as they go in."""
        self.submit_payloads([encode_sample(sample) for sample in samples], poll_s, counters,
                             [sample.trained_tokens for sample in samples])

    def store_results(self, done: List[Tuple[str, ScoredSample]]) -> int:
        """Store (message id, result) pairs once per sample id, each whole under its id and its
        metadata on the results stream, and acknowledge them."""
        return self.store([(msg_id, scored.sample.sample_id, self.keys.results, encode_meta(ResultMeta.of(scored)))
                           for msg_id, scored in done],
                          [(self.keys.result_prefix + scored.sample.sample_id, encode_scored(scored))
                           for _, scored in done])

    def read_results(self, count: int = 1024, block_ms: Optional[int] = 100) -> List[ResultMeta]:
        """The metadata of results not read before, oldest first; read entries are trimmed from the
        stream (the results themselves stay in `self.results` until deleted)."""
        return self._decoded(self.read(self.keys.results, count, block_ms))

    def await_results(self, block_ms: int, count: int = 1024) -> Tuple[List[ResultMeta], Set[str]]:
        """`read_results`, waiting at most `block_ms` for new results or a learner step's end (`announce_step_end`),
        whichever comes first: (the results, the policies whose learner announced a step's end)."""
        found = self._read_streams([self.keys.results, self.keys.learner_steps], count, block_ms)
        stepped = {_text(fields[b"policy"]) for _, fields in found.get(self.keys.learner_steps, [])}
        return self._decoded(_payloads(found.get(self.keys.results, []))), stepped

    def _decoded(self, entries: List[Tuple[str, bytes]]) -> List[ResultMeta]:
        """Each entry's metadata; one that does not decode goes to the dead letters, with the reason."""
        results = []
        for msg_id, raw in entries:
            try:
                results.append(decode_meta(raw))
            except WireFormatError as err:
                self.client.xadd(self.keys.dead, {"data": raw, "reason": str(err), "message_id": msg_id})
        return results

    def unscored_by_policy(self) -> Counter:
        """Samples never scored, by policy: requests still in the stream (held by a worker or
        not yet read) and dead letters. Read once workers have stopped, to account for them."""
        left: Counter = Counter()
        for stream in (self.keys.requests, self.keys.dead):
            for _, fields in self.client.xrange(stream):
                try:
                    left[decode_sample(fields.get(b"data", b"")).policy] += 1
                except WireFormatError:
                    left["<undecodable>"] += 1
        return left

    # job lifecycle
    def publish_rewards(self, specs_json: str) -> None:
        """The job's reward list (JSON) for reward workers started outside the job."""
        self.client.set(self.keys.rewards, specs_json)

    def request_stop(self, keep_s: int = 3600) -> None:
        """Tell every worker of the job to stop; the flag outlives the job for `keep_s`."""
        self.client.set(self.keys.stop, 1, ex=keep_s)

    def stop_requested(self) -> bool:
        return bool(self.client.exists(self.keys.stop))

    def reset(self) -> None:
        """Before a run starts or resumes: nothing left of its own earlier attempt but its status (the keys
        of other runs, of its name or another, are never touched), and the job's producer bound recorded
        for every producer."""
        self._delete_all_but({self.keys.status})
        self.client.set(self.keys.max_pending, self.bound())

    def clear(self) -> None:
        """After a run ends: its queues and counters go; its status and stop flag stay until they expire
        (a week, `job_status.STATUS_TTL_S`; an hour, `request_stop`)."""
        self._delete_all_but({self.keys.status, self.keys.stop})

    def _delete_all_but(self, keep: set) -> None:
        doomed = [k for k in self.client.scan_iter(match=f"{self.keys.prefix}:*", count=1000) if _text(k) not in keep]
        if doomed:
            self.client.delete(*doomed)

    def add_counters(self, key: str, **values: float) -> None:
        """Add to a shared counter hash (`keys.rollout_stats`, `keys.reward_stats`)."""
        pipe = self.client.pipeline(transaction=False)
        for name, value in values.items():
            pipe.hincrbyfloat(key, name, value)
        pipe.execute()

    def counters(self, key: str) -> dict:
        return {k.decode(): float(v) for k, v in self.client.hgetall(key).items()}


STEP_ENDS_KEPT = 64  # learner step ends kept on their stream (approximately) when nothing reads it


def announce_step_end(client: redis.Redis, run: str, policy: str, step: int) -> None:
    """Say that `policy`'s learner has ended RL step `step`: the RL loop, waiting for results (`await_results`),
    wakes at once to record the step and start the next."""
    client.xadd(JobKeys(run).learner_steps, {"policy": policy, "step": step}, maxlen=STEP_ENDS_KEPT,
                approximate=True)


def _payloads(entries: List[Tuple[str, Dict[bytes, bytes]]]) -> List[Tuple[str, bytes]]:
    """(entry id, its `data` field) of each stream entry (empty bytes where it has none)."""
    return [(msg_id, fields.get(b"data", b"")) for msg_id, fields in entries]


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
