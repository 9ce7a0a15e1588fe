"""Rewards the job tests score with (importable by reward workers as `tests.job.rewards_for_tests:<name>`)."""

from __future__ import annotations


def always_raises(sample) -> float:
    """A reward whose backend is gone: every call fails."""
    raise RuntimeError("the grader is unreachable")
