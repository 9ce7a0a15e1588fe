"""The alerts for work the job gave up on: groups past their deadline, and agents' episodes the OpenAI bridges
dropped because their agent went silent.

The RL loop expires groups (`scheduling.group_deadline`) and raises one `groups_expired` alert per check that
expired any; rollout workers push each episode their bridge dropped onto a Redis list
(`PolicyKeys.agent_episodes_expired`), which the loop drains into `agent_episodes_expired` alerts.
"""

from __future__ import annotations

import json
from typing import List

import redis

from rlplatform.scheduling.group_deadline import GroupDeadline

NAMED = 5  # groups or episodes named in one alert; the rest are counted


def expired_groups(policy: str, group_ids: List[str], deadline: GroupDeadline) -> str:
    """One line for the groups of `policy` just expired."""
    how = "rl.group_timeout_s" if deadline.fixed_s is not None else \
        (f"monitoring.hang_factor x the longest a group took, {deadline.longest_s:.1f}s, plus "
         f"{deadline.recovery_s:.0f}s to recover a hung worker")
    return (f"{len(group_ids)} group(s) of policy '{policy}' incomplete {deadline.deadline_s():.0f}s after their "
            f"claim expired ({how}): {_named(group_ids)}; their samples are dropped, issued prompts issued again "
            "and agents' groups closed (a sample lost, a stopped worker, or an agent that went silent)")


def agents_gone(client: redis.Redis, key: str) -> List[str]:
    """Alerts for the episodes the bridges dropped since the last call (drained from list `key`), one per worker."""
    entries = [json.loads(entry) for entry in client.lpop(key, 1000) or []]
    by_worker = {}
    for entry in entries:
        by_worker.setdefault(entry["worker"], []).append(entry)
    return [f"{len(gone)} agent episode(s) on {worker} made no request for {max(e['idle_s'] for e in gone):.0f}s, "
            f"past the bridge's idle deadline ({gone[0]['deadline_s']:.0f}s): dropped; "
            f"{_named([e['episode'] + (' from ' + e['client'] if e['client'] else '') for e in gone])}; "
            "their agents stopped or went away, and a late request of theirs is answered 410"
            for worker, gone in by_worker.items()]


def _named(items: List[str]) -> str:
    return ", ".join(items[:NAMED]) + (f" and {len(items) - NAMED} more" if len(items) > NAMED else "")
