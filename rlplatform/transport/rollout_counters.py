"""A policy's rollout counters: one typed record, summed over its rollout workers in one Redis hash.

Rollout workers add to it as they go (`RolloutCounterHash.add`: generation and submit time, weight syncs,
multi-turn episodes and their tool calls, the decode batch while episodes wait on tools); the scoring queues'
Lua script adds the samples and model tokens of each part it takes in, under the field names `SUBMITTED` gives
it. The RL loop (its summary and checkpoints) and its monitor (rates, busy fractions, the tool figures) read the
hash back as one `RolloutCounters`. A worker Ray restarts loses none of them: they live on Redis.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, asdict, dataclass, fields
from typing import Dict

import redis


@dataclass(frozen=True)
class RolloutCounters:
    """The rollout counters' values: totals, or (`minus`) their increase over an interval."""
    samples: float = 0.0  # generated samples the scoring queue took in
    tokens: float = 0.0  # their completion tokens
    busy_s: float = 0.0  # seconds the workers spent generating
    submit_s: float = 0.0  # and submitting to the scoring queue
    weight_syncs: float = 0.0  # newer versions loaded by the generation loops
    _: KW_ONLY
    weight_sync_s: float = 0.0  # seconds those loads took
    weight_sync_bytes: float = 0.0  # bytes received by every load (with LoRA, the adapters' alone)
    episodes: float = 0.0  # multi-turn episodes ended
    episodes_truncated: float = 0.0  # of them, cut at the turn or token limit
    turns: float = 0.0  # their model turns
    tool_calls: float = 0.0
    observation_tokens: float = 0.0  # tokens the environment put into the conversations
    malformed_calls: float = 0.0
    unknown_tool_calls: float = 0.0
    token_checks: float = 0.0  # episodes checked token for token against their conversation (chat templates)
    token_mismatches: float = 0.0  # of them, those whose tokens differed
    decode_steps_while_waiting: float = 0.0  # decode steps taken while episodes waited on tools
    sequences_while_waiting: float = 0.0  # the sequences those steps decoded, summed
    idle_s_while_waiting: float = 0.0  # seconds the decode batch sat empty while episodes waited
    agent_episodes_expired: float = 0.0  # agents' episodes the OpenAI bridges dropped, their agents silent too long

    @classmethod
    def of(cls, values: Dict[str, float]) -> "RolloutCounters":
        """From field values (a read hash, a checkpoint's mirror); a name that is not a counter is an error."""
        unknown = sorted(set(values) - FIELDS)
        if unknown:
            raise ValueError(f"not rollout counters: {', '.join(unknown)} (they are {', '.join(sorted(FIELDS))})")
        return cls(**{name: float(value) for name, value in values.items()})

    def minus(self, earlier: "RolloutCounters") -> "RolloutCounters":
        """The increase since `earlier`."""
        return RolloutCounters(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    def as_dict(self) -> Dict[str, float]:
        return asdict(self)


FIELDS = frozenset(f.name for f in fields(RolloutCounters))
SUBMITTED = ("samples", "tokens")  # the fields the scoring queues' submit script adds to: requests, model tokens
assert FIELDS.issuperset(SUBMITTED)


class RolloutCounterHash:
    """The Redis hash of one policy's rollout counters (`PolicyKeys.rollout_stats`)."""

    def __init__(self, client: redis.Redis, key: str) -> None:
        self.client, self.key = client, key

    def add(self, **values: float) -> None:
        """Add to the named counters, in one round trip; a name that is not a counter is an error."""
        RolloutCounters.of(values)
        add_to_counters(self.client, self.key, values)

    def read(self) -> RolloutCounters:
        return RolloutCounters.of(read_counters(self.client, self.key))


def add_to_counters(client: redis.Redis, key: str, values: Dict[str, float]) -> None:
    """Add `values` to the counter hash `key`, in one round trip (any counter hash: the reward, tool and teacher
    workers' too)."""
    pipe = client.pipeline(transaction=False)
    for name, value in values.items():
        pipe.hincrbyfloat(key, name, value)
    pipe.execute()


def read_counters(client: redis.Redis, key: str) -> Dict[str, float]:
    return {name.decode(): float(value) for name, value in client.hgetall(key).items()}
