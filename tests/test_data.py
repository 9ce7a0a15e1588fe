"""Generated addition data: correct answers, reproducible, and with `disjoint_test` a held-out
split whose problems never appear in training."""

from __future__ import annotations

import pytest

from rlplatform.config import ConfigError, DataConfig, load_config
from rlplatform.data import load_rows


def test_addition_rows_are_correct_and_reproducible():
    train, test = load_rows(DataConfig(train_size=300, test_size=50), seed=3)
    assert (train, test) == load_rows(DataConfig(train_size=300, test_size=50), seed=3)
    for row in train + test:
        a, b = row["prompt"].rstrip("=").split("+")
        assert row["answer"] == str(int(a) + int(b)) and 0 <= int(a) <= 99 and 0 <= int(b) <= 99


def test_test_rows_are_independent_draws_by_default():
    train, test = load_rows(DataConfig(digits=1, train_size=2000, test_size=40), seed=0)
    assert len({row["prompt"] for row in train}) == 100  # the whole 1-digit problem space is trained on


def test_held_out_problems_are_distinct_and_never_in_training():
    train, test = load_rows(DataConfig(digits=1, train_size=2000, test_size=40, disjoint_test=True), seed=0)
    test_prompts = [row["prompt"] for row in test]
    assert len(set(test_prompts)) == 40
    train_prompts = {row["prompt"] for row in train}
    assert not train_prompts & set(test_prompts)
    assert len(train_prompts) == 100 - 40  # every other 1-digit problem is trained on


def test_holding_out_more_than_half_the_problems_is_a_config_error():
    with pytest.raises(ConfigError, match="'data.test_size' is 60; at most 50"):
        load_config(None, ["data.digits=1", "data.test_size=60", "data.disjoint_test=true"])
