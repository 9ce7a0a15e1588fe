"""The SFT learning-rate schedule (`sft.warmup_steps`, `sft.lr_schedule`): a linear rise from 0 over the warm-up,
then constant or a cosine decay to 10% of `sft.lr` at `sft.steps`."""

from __future__ import annotations

import pytest

from rlplatform.config import SFTConfig
from rlplatform.job.sft import lr_fraction


def test_warm_up_rises_linearly_then_the_rate_holds():
    config = SFTConfig(steps=1000, warmup_steps=3)
    assert [lr_fraction(config, step) for step in (1, 2, 3, 4, 1000)] == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_cosine_decays_from_the_full_rate_to_a_tenth_at_the_last_step():
    config = SFTConfig(steps=1100, warmup_steps=100, lr_schedule="cosine")
    assert lr_fraction(config, 100) == pytest.approx(100 / 101)  # the last warm-up step
    assert lr_fraction(config, 101) == pytest.approx(1.0, abs=1e-5)
    assert lr_fraction(config, 600) == pytest.approx(0.55)  # half way: 0.1 + 0.9 / 2
    assert lr_fraction(config, 1100) == pytest.approx(0.1)


def test_no_warm_up_and_constant_is_the_rate_unchanged():
    assert {lr_fraction(SFTConfig(steps=10), step) for step in range(1, 11)} == {1.0}
