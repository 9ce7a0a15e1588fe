"""Text-shape rewards: format, pattern and length scores on hand-written completions."""

from __future__ import annotations

import pytest

from rlplatform.rewards.text_rewards import format_match, length_reward, regex_contains


@pytest.mark.parametrize("completion, expected", [
    ("<think>add the tens</think>\n<answer>85</answer>", 1.0),
    ("  <think>\nmulti\nline\n</think><answer>85</answer>\n", 1.0),  # surrounding space stripped, . spans lines
    ("<answer>85</answer>", 0.0),  # no reasoning block
    ("<think>x</think><answer>85</answer> and more", 0.0),  # the whole completion must match
])
def test_format_match_default_think_answer(make_sample, completion, expected):
    assert format_match(make_sample(completion)) == expected


def test_format_match_custom_pattern(make_sample):
    assert format_match(make_sample("85"), pattern=r"-?\d+") == 1.0
    assert format_match(make_sample("85 apples"), pattern=r"-?\d+") == 0.0


def test_regex_contains(make_sample):
    sample = make_sample("So the Answer: 85")
    assert regex_contains(sample, pattern=r"answer: \d+") == 0.0
    assert regex_contains(sample, pattern=r"answer: \d+", ignore_case=True) == 1.0
    assert regex_contains(sample, pattern=r"\d{3}") == 0.0


@pytest.mark.parametrize("length, expected", [(0, 1.0), (10, 1.0), (13, 0.7), (15, 0.5), (20, 0.0), (50, 0.0)])
def test_length_reward_falls_linearly_past_the_target(make_sample, length, expected):
    # 1 up to target_len = 10 tokens, then 1 - (length - 10) / 10, floored at 0
    assert length_reward(make_sample("x" * length), target_len=10) == pytest.approx(expected)
