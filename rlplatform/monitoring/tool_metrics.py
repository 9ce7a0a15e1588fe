"""Figures of multi-turn episodes and their tool calls, for W&B (the `tools` family) and the summary.

Consumes the policy's rollout counters (`RolloutCounters`: episodes, turns, tool_calls,
observation_tokens, episodes_truncated, malformed and unknown-tool calls, token_checks and
token_mismatches (the exact-token check of chat-template episodes), and the decode batch
while episodes wait on tools) and the counters tool workers add up per
tool (calls/<tool>, errors/<tool>, latency_s/<tool>); produces per-episode means, the truncated
fraction, the batch's occupancy and idle time while waiting and, per tool, calls, error fraction
and mean latency.
"""

from __future__ import annotations

from typing import Dict

from rlplatform.transport.rollout_counters import RolloutCounters


def tool_figures(rollout: RolloutCounters, tools: Dict[str, float], decode_slots: int) -> Dict[str, float]:
    """Figures of the counters' values (totals, or their increase over an interval); `decode_slots`: the
    sequences a worker's batch holds at most (rollout.prompts_per_batch x rl.group_size)."""
    episodes = max(rollout.episodes, 1.0)
    figures = {"episodes": rollout.episodes,
               "turns_per_episode": rollout.turns / episodes,
               "tool_calls_per_episode": rollout.tool_calls / episodes,
               "observation_tokens_per_episode": rollout.observation_tokens / episodes,
               "truncated_fraction": rollout.episodes_truncated / episodes,
               "episodes_truncated": rollout.episodes_truncated,
               "malformed_calls": rollout.malformed_calls,
               "unknown_tool_calls": rollout.unknown_tool_calls,
               "token_checks": rollout.token_checks,  # episodes checked against their conversation
               "token_mismatches": rollout.token_mismatches,
               **_while_waiting(rollout, decode_slots)}
    for name in sorted(key.split("/", 1)[1] for key in tools if key.startswith("calls/")):
        calls = tools[f"calls/{name}"]
        figures[f"{name}/calls"] = calls
        figures[f"{name}/error_fraction"] = tools.get(f"errors/{name}", 0.0) / max(calls, 1.0)
        figures[f"{name}/latency_s"] = tools.get(f"latency_s/{name}", 0.0) / max(calls, 1.0)
    return figures


def _while_waiting(rollout: RolloutCounters, decode_slots: int) -> Dict[str, float]:
    """The decode batch while episodes waited on tools: steps, mean sequences per step (also as a fraction
    of the batch's slots) and seconds it sat empty."""
    steps = rollout.decode_steps_while_waiting
    occupancy = rollout.sequences_while_waiting / max(steps, 1.0)
    return {"decode_steps_while_waiting": steps, "decode_occupancy_while_waiting": occupancy,
            "decode_slots_used_while_waiting": occupancy / decode_slots,
            "idle_s_while_waiting": rollout.idle_s_while_waiting}
