"""The prompt ledger: every group a rollout worker starts, from issue to its end, kept on Redis.

Rollout workers take prompts from it (`issue`: prompts a dead worker abandoned or an expired
group held first, then the next positions of a seeded shuffle of the training rows); an agent's
group, played through the OpenAI bridge, enters it when its first episode finishes (`admit`: no
data position, so nothing to issue again); the RL loop closes each group once as trained, dropped,
expired or abandoned. Its counts balance: issued (admitted included) = closed + still open.
Its `state` goes into every checkpoint, so a resumed job re-issues the prompts that were in flight.
"""

from __future__ import annotations

import random
import time
from functools import lru_cache
from typing import Callable, Dict, List, Optional, Tuple

import redis

from rlplatform.transport.keys import PolicyKeys

OUTCOMES = ("trained", "dropped_stale", "dropped_error", "dropped_zero_advantage", "expired", "abandoned")
AGENT = -1  # the position an agent's group holds: none of the data's

# KEYS: open, counts, agents_ended. ARGV: group, now. Opens an agent's group unless it is open (0) or has
# ended (-1); 1 if it opened it.
_ADMIT = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1 then return -1 end
redis.call('HSET', KEYS[1], ARGV[1], '-1 ' .. ARGV[2])
redis.call('HINCRBY', KEYS[2], 'issued', 1)
redis.call('HINCRBY', KEYS[2], 'admitted', 1)
return 1
"""

# KEYS: reissue, cursor, seq, open, claimed, attempt, counts. ARGV: groups, worker, now, policy.
_ISSUE = """
local out = {}
local attempt = redis.call('GET', KEYS[6]) or '0'
for i = 1, tonumber(ARGV[1]) do
  local prompt = redis.call('LPOP', KEYS[1])
  if prompt then
    redis.call('HINCRBY', KEYS[7], 'reissued', 1)
  else
    prompt = tostring(redis.call('INCR', KEYS[2]) - 1)
  end
  local group = ARGV[4] .. '-a' .. attempt .. '-g' .. redis.call('INCR', KEYS[3])
  redis.call('HSET', KEYS[4], group, prompt .. ' ' .. ARGV[3])
  redis.call('HSET', KEYS[5], group, ARGV[2])
  redis.call('HINCRBY', KEYS[7], 'issued', 1)
  table.insert(out, group)
  table.insert(out, prompt)
end
return out
"""

# KEYS: open, claimed, counts, reissue, agents_ended. ARGV: group, outcome, '1' to queue its prompt for re-issue.
# Returns the group's prompt position the first time it is closed, else false. An agent's group is remembered
# as ended: its agent cannot open it again.
_CLOSE = """
local entry = redis.call('HGET', KEYS[1], ARGV[1])
if not entry then return false end
local prompt = string.match(entry, '^(%S+)')
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HINCRBY', KEYS[3], ARGV[2], 1)
if prompt == '-1' then redis.call('SADD', KEYS[5], ARGV[1]) end
if ARGV[3] == '1' and prompt ~= '-1' then redis.call('RPUSH', KEYS[4], prompt) end
return prompt
"""

# KEYS: open, claimed, counts, reissue, agents_ended. ARGV: worker. Returns how many groups it abandoned.
_ABANDON = """
local claimed = redis.call('HGETALL', KEYS[2])
local abandoned = 0
for i = 1, #claimed, 2 do
  if claimed[i + 1] == ARGV[1] then
    local entry = redis.call('HGET', KEYS[1], claimed[i])
    redis.call('HDEL', KEYS[2], claimed[i])
    if entry then
      redis.call('HDEL', KEYS[1], claimed[i])
      redis.call('RPUSH', KEYS[4], string.match(entry, '^(%S+)'))
      redis.call('HINCRBY', KEYS[3], 'abandoned', 1)
      abandoned = abandoned + 1
    end
  end
end
return abandoned
"""


@lru_cache(maxsize=4)
def _shuffle(seed: int, rows: int, epoch: int) -> Tuple[int, ...]:
    order = list(range(rows))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return tuple(order)


def prompt_row(position: int, rows: int, seed: int) -> int:
    """The training row at prompt `position`: each pass over the data is a fresh seeded shuffle."""
    return _shuffle(seed, rows, position // rows)[position % rows]


class PromptLedger:
    """One policy's ledger on Redis, shared by its rollout workers and the RL loop."""

    def __init__(self, client: redis.Redis, run: str, policy: str, clock: Callable[[], float] = time.time) -> None:
        """`run`: the run's `run_scope`. `clock`: wall-clock seconds, shared by every process that holds this
        ledger (tests pass their own)."""
        self.client, self.policy, self.clock = client, policy, clock
        keys = PolicyKeys(run, policy).ledger
        self.open, self.claimed, self.counts_key = keys.open, keys.claimed, keys.counts
        self.reissue, self.cursor, self.seq, self.attempt = keys.reissue, keys.cursor, keys.seq, keys.attempt
        self.agents_ended = keys.agents_ended
        # what ending a group touches
        self._ending_keys = [self.open, self.claimed, self.counts_key, self.reissue, self.agents_ended]
        self._issue = client.register_script(_ISSUE)
        self._close = client.register_script(_CLOSE)
        self._abandon = client.register_script(_ABANDON)
        self._admit = client.register_script(_ADMIT)

    def issue(self, worker: int, groups: int) -> List[Tuple[str, int]]:
        """(group id, prompt position) for `groups` new groups claimed by rollout worker `worker`."""
        if groups <= 0:
            return []
        keys = [self.reissue, self.cursor, self.seq, self.open, self.claimed, self.attempt, self.counts_key]
        flat = self._issue(keys=keys, args=[groups, worker, f"{self.clock():.3f}", self.policy])
        return [(_text(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2)]

    def admit(self, group_id: str) -> Optional[bool]:
        """Open an agent's group `group_id` (position `AGENT`); False when it is open already, None when it has
        ended (an agent's group is played once)."""
        opened = int(self._admit(keys=[self.open, self.counts_key, self.agents_ended],
                                 args=[group_id, f"{self.clock():.3f}"]))
        return None if opened < 0 else bool(opened)

    def has_ended(self, group_id: str) -> bool:
        """Whether `group_id` is an agent's group that has ended."""
        return bool(self.client.sismember(self.agents_ended, group_id))

    def submitted(self, group_ids: List[str]) -> None:
        """These groups are in the reward queue now: a restart of their worker no longer abandons them."""
        if group_ids:
            self.client.hdel(self.claimed, *group_ids)

    def close(self, group_id: str, outcome: str, reissue: bool = False) -> Optional[int]:
        """End a group as `outcome` (with `reissue`, its prompt is issued again, an agent's group having none);
        returns its prompt position (`AGENT` for an agent's group), or None when it had already ended (it
        counts once)."""
        position = self._close(keys=self._ending_keys, args=[group_id, outcome, int(reissue)])
        return int(position) if position is not None else None

    def close_all(self, group_ids: List[str], outcome: str) -> List[Optional[int]]:
        """`close` for each group (no re-issue), in one round trip to Redis."""
        pipe = self.client.pipeline(transaction=False)
        for group_id in group_ids:
            self._close(keys=self._ending_keys, args=[group_id, outcome, 0], client=pipe)
        return [int(position) if position is not None else None for position in pipe.execute()]

    def abandon_worker(self, worker: int) -> int:
        """A restarted worker's predecessor's unsubmitted groups: closed, their prompts queued for re-issue."""
        return int(self._abandon(keys=self._ending_keys, args=[worker]))

    def position(self, group_id: str) -> Optional[int]:
        """The prompt position of open group `group_id` (`AGENT` for an agent's group); None when the ledger did not
        issue or admit it, or it has ended."""
        entry = self.client.hget(self.open, group_id)
        return None if entry is None else int(entry.split()[0])

    def open_since(self) -> Dict[str, float]:
        """Every open group's claim time (`clock` seconds)."""
        return {_text(group): float(entry.split()[1]) for group, entry in self.client.hgetall(self.open).items()}

    def counts(self) -> Dict[str, int]:
        """issued, reissued, admitted (agents' groups, among the issued), each outcome, and `open` (issued and not
        ended yet)."""
        stored, open_groups = self.client.pipeline(transaction=True).hgetall(self.counts_key).hlen(self.open).execute()
        return _counts(stored, open_groups)

    def state(self) -> Dict:
        """What a checkpoint keeps: the data position, the counts and the prompts still in flight, read
        in one transaction (rollout workers keep issuing meanwhile; no prompt may fall between reads)."""
        return self.snapshot()[0]

    def snapshot(self) -> Tuple[Dict, Dict[str, int]]:
        """`state()`, and the open groups' prompt positions by group id (AGENT for an agent's), from the same
        transaction."""
        pipe = self.client.pipeline(transaction=True)
        pipe.hgetall(self.open).lrange(self.reissue, 0, -1).get(self.cursor).get(self.seq).hgetall(self.counts_key)
        entries, reissue, cursor, seq, stored = pipe.execute()
        positions = {_text(group): int(entry.split()[0]) for group, entry in entries.items()}
        counts = _counts(stored, len(entries))
        return {"cursor": int(cursor or 0), "seq": int(seq or 0),
                "counts": {k: v for k, v in counts.items() if k != "open"}, "open": counts["open"],
                "in_flight_prompts": [p for p in positions.values() if p != AGENT] + [int(p) for p in reissue]}, \
            positions

    def restore(self, state: Dict, attempt: int) -> None:
        """Continue from a checkpoint's `state`: prompts in flight then are re-issued first."""
        counts = dict(state["counts"])
        counts["abandoned"] = counts.get("abandoned", 0) + state["open"]
        pipe = self.client.pipeline(transaction=True)
        pipe.delete(self.open, self.claimed, self.reissue, self.counts_key)
        pipe.set(self.cursor, state["cursor"])
        pipe.set(self.seq, state["seq"])
        pipe.set(self.attempt, attempt)
        pipe.hset(self.counts_key, mapping=counts)
        if state["in_flight_prompts"]:
            pipe.rpush(self.reissue, *state["in_flight_prompts"])
        pipe.execute()


def balanced(counts: Dict[str, int]) -> bool:
    """Every issued group ended in exactly one outcome or is still open."""
    return counts["issued"] == sum(counts[name] for name in OUTCOMES) + counts["open"]


def _counts(stored: Dict, open_groups: int) -> Dict[str, int]:
    named = {_text(k): int(v) for k, v in stored.items()}
    return {**{name: named.get(name, 0) for name in ("issued", "reissued", "admitted", *OUTCOMES)},
            "open": int(open_groups)}


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
