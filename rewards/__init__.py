"""Reward services: the registry of reward functions, built-in verifiers and the reward worker."""

from rlplatform.rewards import verifiers  # noqa: F401  (registers the built-in rewards)
from rlplatform.rewards.registry import REWARDS, UnknownReward, register, resolve

__all__ = ["REWARDS", "UnknownReward", "register", "resolve"]
