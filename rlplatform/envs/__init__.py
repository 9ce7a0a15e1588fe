"""Episodes and tools: how a rollout becomes several model turns.

An environment (`environment.Environment`) turns a data row into the first prompt and answers
each model turn with observations, tool calls or the end of the episode. Tool calls run on tool
workers (`tool_worker`) behind the job's tool queue on Redis, as rewards run on reward workers;
tools register like rewards (`tools`). The rollout side that drives episodes is `actors/episodes.py`.
"""

from rlplatform.envs.tools import tool

__all__ = ["tool"]
