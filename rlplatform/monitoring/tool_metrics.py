"""Figures of multi-turn episodes and their tool calls, for W&B (the `tools` family) and the summary.

Consumes the counters rollout workers add up on Redis (episodes, turns, tool_calls,
observation_tokens, episodes_truncated, malformed and unknown-tool calls, token_checks and
token_mismatches (the exact-token check of chat-template episodes), and the decode batch
while episodes wait on tools, under the policy's rollout stats) and those tool workers add up per
tool (calls/<tool>, errors/<tool>, latency_s/<tool>); produces per-episode means, the truncated
fraction, the batch's occupancy and idle time while waiting and, per tool, calls, error fraction
and mean latency.
"""

from __future__ import annotations

from typing import Dict

EPISODE_COUNTERS = ("episodes", "turns", "tool_calls", "observation_tokens", "episodes_truncated",
                    "malformed_calls", "unknown_tool_calls", "token_checks", "token_mismatches")


def tool_figures(rollout: Dict[str, float], tools: Dict[str, float], decode_slots: int) -> Dict[str, float]:
    """Figures of the counters' values (totals, or their increase over an interval); `decode_slots`: the
    sequences a worker's batch holds at most (rollout.prompts_per_batch x rl.group_size)."""
    episodes = max(rollout.get("episodes", 0.0), 1.0)
    figures = {"episodes": rollout.get("episodes", 0.0),
               "turns_per_episode": rollout.get("turns", 0.0) / episodes,
               "tool_calls_per_episode": rollout.get("tool_calls", 0.0) / episodes,
               "observation_tokens_per_episode": rollout.get("observation_tokens", 0.0) / episodes,
               "truncated_fraction": rollout.get("episodes_truncated", 0.0) / episodes,
               "episodes_truncated": rollout.get("episodes_truncated", 0.0),
               "malformed_calls": rollout.get("malformed_calls", 0.0),
               "unknown_tool_calls": rollout.get("unknown_tool_calls", 0.0),
               "token_checks": rollout.get("token_checks", 0.0),  # episodes checked against their conversation
               "token_mismatches": rollout.get("token_mismatches", 0.0),
               **_while_waiting(rollout, decode_slots)}
    for name in sorted(key.split("/", 1)[1] for key in tools if key.startswith("calls/")):
        calls = tools[f"calls/{name}"]
        figures[f"{name}/calls"] = calls
        figures[f"{name}/error_fraction"] = tools.get(f"errors/{name}", 0.0) / max(calls, 1.0)
        figures[f"{name}/latency_s"] = tools.get(f"latency_s/{name}", 0.0) / max(calls, 1.0)
    return figures


def _while_waiting(rollout: Dict[str, float], decode_slots: int) -> Dict[str, float]:
    """The decode batch while episodes waited on tools: steps, mean sequences per step (also as a fraction
    of the batch's slots) and seconds it sat empty."""
    steps = rollout.get("decode_steps_while_waiting", 0.0)
    occupancy = rollout.get("sequences_while_waiting", 0.0) / max(steps, 1.0)
    return {"decode_steps_while_waiting": steps, "decode_occupancy_while_waiting": occupancy,
            "decode_slots_used_while_waiting": occupancy / decode_slots,
            "idle_s_while_waiting": rollout.get("idle_s_while_waiting", 0.0)}
