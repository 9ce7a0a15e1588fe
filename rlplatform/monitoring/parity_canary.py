"""The parity canary: fixed token sequences scored by the learner and by each rollout engine at the
same weight version, so a weight sync that left part of the model behind shows within
`monitoring.parity_every` versions (its first check comes before any sampled token is trained on).

Data flow: the canary is the first `CANARY_PROMPTS` training prompts of the policy (each scored on its
tokens after the first, teacher-forced) -> the learner scores it with each canary version it streams (the
multiples of `parity_every`: `canary_version`) and rank 0 stores the sequences and log-probs on Redis
(`PolicyKeys.canary_reference`, the newest version only) before the version is announced -> a rollout
worker that loads a canary version scores the same sequences with its engine, compares (mean and max
|Δ log-prob|) and
adds the result to the policy's `canary_checks` stream -> the RL monitor reports each new check (W&B
`canary/…`, summary `rl.parity.canary`) and the `parity` alert rule fires on it as on the learner's
own parity figures.
"""

from __future__ import annotations

import json
from typing import Dict, List, Optional, Sequence, Tuple

CANARY_PROMPTS = 4  # fixed prompts per check
CHECKS_KEPT = 100  # the newest checks a policy keeps on Redis


def canary_sequences(prompt_ids: Sequence[List[int]]) -> Tuple[List[List[int]], List[List[int]]]:
    """(first tokens, scored tokens) of the canary: the first `CANARY_PROMPTS` prompts of two or more tokens."""
    chosen = [ids for ids in prompt_ids if len(ids) >= 2][:CANARY_PROMPTS]
    return [ids[:1] for ids in chosen], [ids[1:] for ids in chosen]


def canary_version(version: int, every: int) -> bool:
    """Whether `version` is checked: the learner scores, and engines check, every `every`-th version."""
    return version % every == 0


def store_reference(client, key: str, version: int, first: List[List[int]], scored: List[List[int]],
                    *, logprobs: List[List[float]]) -> None:
    """The canary and the learner's log-probs of it for `version` (only the newest is kept)."""
    client.set(key, json.dumps({"version": version, "first": first, "scored": scored, "logprobs": logprobs}))


def compare(reference: List[List[float]], engine: List[List[float]]) -> Dict[str, float]:
    """abs_mean, abs_max and tokens of |Δ log-prob| between the learner's and an engine's canary scores."""
    gaps = [abs(a - b) for ref, got in zip(reference, engine) for a, b in zip(ref, got)]
    return {"abs_mean": sum(gaps) / max(len(gaps), 1), "abs_max": max(gaps, default=0.0), "tokens": float(len(gaps))}


class CanaryCheck:
    """A rollout worker's side: checks the engine against the learner's reference at each canary version it
    loads (one it skips waits for the next)."""

    def __init__(self, client, reference_key: str, checks_key: str, every: int, worker: int) -> None:
        self.client, self.reference_key, self.checks_key = client, reference_key, checks_key
        self.every, self.worker = every, worker

    def due(self, version: int) -> bool:
        """Whether a newly loaded `version` is checked."""
        return canary_version(version, self.every)

    def run(self, version: int, score) -> Optional[Dict[str, float]]:
        """Compare `score(first tokens, scored tokens)` (the engine's log-probs) with the learner's for
        `version`; None (the next canary version loaded is checked) when the learner's reference is another version."""
        raw = self.client.get(self.reference_key)
        reference = json.loads(raw) if raw else None
        if reference is None or reference["version"] != version:
            return None
        figures = compare(reference["logprobs"], score(reference["first"], reference["scored"]))
        record = {"version": version, "worker": self.worker, **figures}
        self.client.xadd(self.checks_key, {"check": json.dumps(record)}, maxlen=CHECKS_KEPT, approximate=True)
        return figures


def checks_since(client, checks_key: str, last_id: Optional[str]) -> Tuple[List[Dict], Optional[str]]:
    """(the checks recorded after entry `last_id` (None: all kept), the newest entry's id)."""
    entries = client.xrange(checks_key, min="-" if last_id is None else f"({last_id}")
    if not entries:
        return [], last_id
    return [json.loads(fields[b"check"]) for _, fields in entries], entries[-1][0].decode()
