"""DAPO's soft overlong penalty by hand, as the RL loop adds it to a scored sample, and the limit
the config holds it to."""

from __future__ import annotations

import pytest

from rlplatform.config import ConfigError, load_config
from rlplatform.job.rl_loop import _shaped
from rlplatform.rewards.shaping import overlong_penalty
from rlplatform.transport.samples import ResultMeta


@pytest.mark.parametrize("length,penalty", [(0, 0.0), (10, 0.0), (15, 0.0), (16, -0.2), (18, -0.6), (20, -1.0),
                                            (25, -1.0)])
def test_overlong_penalty_at_chosen_lengths(length, penalty):
    # limit 20, buffer 5: free up to 15 tokens, then (15 - length) / 5 down to -1 at 20
    assert overlong_penalty(length, max_tokens=20, buffer=5) == pytest.approx(penalty)


def test_the_loop_adds_the_penalty_to_the_reward_and_as_a_component():
    scored = ResultMeta("g/0", "g", "policy", 0, 3, completion_tokens=18, reward=1.0, components={"exact_match": 1.0})
    shaped = _shaped(scored, max_tokens=20, buffer=5)
    assert shaped.reward == pytest.approx(0.4)
    assert shaped.components == {"exact_match": 1.0, "overlong_penalty": pytest.approx(-0.6)}
    assert scored.reward == 1.0  # the original is unchanged


def test_the_buffer_must_end_before_the_limit(tmp_path):
    with pytest.raises(ConfigError, match="'rl.overlong_buffer' is 6; it must be below the completion limit it "
                                          "ends at \\(6 tokens\\)"):
        load_config(None, [f"output_dir={tmp_path}", "rl.max_new_tokens=6", "rl.overlong_buffer=6"])
    assert load_config(None, [f"output_dir={tmp_path}", "rl.max_new_tokens=6", "rl.overlong_buffer=5"])
