"""Reward services: the registry of reward functions, the built-in rewards, the scorer that
runs them and the reward worker that serves a job's queue."""

from rlplatform.rewards import builtins  # noqa: F401  (registers the built-in rewards)
from rlplatform.rewards.registry import REWARDS, RewardSpecError, all_rewards, register, resolve, reward

__all__ = ["REWARDS", "RewardSpecError", "all_rewards", "register", "resolve", "reward"]
