"""rlplatform: asynchronous RL post-training for language models.

`rlplatform.reward` registers a reward function under a name a job's YAML can use.
"""

from rlplatform.rewards.registry import reward

__all__ = ["reward"]
