"""Figures of multi-turn episodes and their tool calls, for W&B (the `tools` family) and the summary.

Consumes the counters rollout workers add up on Redis (episodes, turns, tool_calls,
observation_tokens, episodes_truncated, under the policy's rollout stats) and those tool workers
add up per tool (calls/<tool>, errors/<tool>, latency_s/<tool>); produces per-episode means,
the truncated fraction and, per tool, calls, error fraction and mean latency.
"""

from __future__ import annotations

from typing import Dict

EPISODE_COUNTERS = ("episodes", "turns", "tool_calls", "observation_tokens", "episodes_truncated")


def tool_figures(rollout: Dict[str, float], tools: Dict[str, float]) -> Dict[str, float]:
    """Figures of the counters' values (totals, or their increase over an interval)."""
    episodes = max(rollout.get("episodes", 0.0), 1.0)
    figures = {"episodes": rollout.get("episodes", 0.0),
               "turns_per_episode": rollout.get("turns", 0.0) / episodes,
               "tool_calls_per_episode": rollout.get("tool_calls", 0.0) / episodes,
               "observation_tokens_per_episode": rollout.get("observation_tokens", 0.0) / episodes,
               "truncated_fraction": rollout.get("episodes_truncated", 0.0) / episodes,
               "episodes_truncated": rollout.get("episodes_truncated", 0.0)}
    for name in sorted(key.split("/", 1)[1] for key in tools if key.startswith("calls/")):
        calls = tools[f"calls/{name}"]
        figures[f"{name}/calls"] = calls
        figures[f"{name}/error_fraction"] = tools.get(f"errors/{name}", 0.0) / max(calls, 1.0)
        figures[f"{name}/latency_s"] = tools.get(f"latency_s/{name}", 0.0) / max(calls, 1.0)
    return figures
