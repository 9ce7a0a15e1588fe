"""Reward shaping the RL loop adds to each scored sample before groups are judged and advantages
computed: terms that depend on the rollout, not on what a reward function can see.

`overlong_penalty` is DAPO's soft overlong punishment: no penalty up to `max_tokens - buffer`
completion tokens, then falling linearly to -1 at `max_tokens`, and -1 beyond.
"""

from __future__ import annotations


def overlong_penalty(length: int, max_tokens: int, buffer: int) -> float:
    """The penalty of a completion of `length` tokens under a limit of `max_tokens`, soft over the
    last `buffer` tokens before it."""
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    if length > max_tokens:
        return -1.0
    return (start - length) / buffer
