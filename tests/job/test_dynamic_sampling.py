"""Dynamic sampling in a real job: groups whose rewards are all equal are dropped and replaced, so every
batch the learner gets is full of groups with signal."""

from __future__ import annotations

from rlplatform.config import RewardSpec
from rlplatform.job.controller import run_job


def test_every_batch_holds_groups_with_signal(ray_session, tiny_job):
    # an untrained model's first character is a digit 0-4 about one time in six: about half the groups of 4
    # completions get the same reward for all four
    config = tiny_job("dynamic", "rl.max_steps=6", "rl.dynamic_sampling=true", "rl.dynamic_sampling_limit=50")
    config.rewards = [RewardSpec(name="regex_contains", params={"pattern": "^[0-4]"})]
    rl = run_job(config)["rl"]
    assert rl["steps"] == 6 and rl["samples_trained"] == 6 * 2 * 4  # full batches
    assert rl["signal_group_fraction"] == 1.0
    assert rl["samples_dropped_zero_advantage"] > 0 and rl["samples_dropped_zero_advantage"] % 4 == 0
