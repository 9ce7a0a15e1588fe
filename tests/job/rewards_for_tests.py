"""Rewards the job tests score with (importable by reward workers as `tests.job.rewards_for_tests:<name>`)."""

from __future__ import annotations

import time


def always_raises(sample) -> float:
    """A reward whose backend is gone: every call fails."""
    raise RuntimeError("the grader is unreachable")


def agrees_with_verifiers(sample) -> float:
    """1.0 when the reward verifiers reported for the episode is the exact match of this sample's own completion
    with its task's answer: the episode's tokens and its reward belong together."""
    matched = float(sample.completion.strip() == str(sample.row["answer"]).strip())
    return float(matched == float(sample.row["verifiers_reward"]))


def hangs_from_version_2(sample, hanging: str = "") -> float:
    """Exact match for the samples of policy versions 0 and 1; from version 2 on, a call that hangs (past its timeout),
    having first created the file `hanging` (where given) for the test to wait on."""
    if max(sample.token_versions, default=0) >= 2:
        if hanging:
            open(hanging, "a").close()
        time.sleep(300)
    return float(sample.completion.strip() == str(sample.row["answer"]).strip())
