"""Alert rules on synthetic step figures: each rule fires once when its condition starts, and
re-arms when it clears."""

from __future__ import annotations

from rlplatform.config import AlertRule
from rlplatform.monitoring.alerts import AlertRules, StepFigures


def figures(step, reward=0.5, errors=0.0, queue=0, idle_s=0.0, scored=100):
    """A step's figures; `errors`: the fraction of its `scored` samples that were reward errors."""
    return StepFigures(step, reward, errors, queue, idle_s, scored=scored, errors=round(errors * scored))


def fired(rules, series):
    return [(a.kind, a.step) for step, f in enumerate(series, 1) for a in rules.check(f)]


def test_reward_collapse_fires_once_when_the_window_mean_halves():
    rules = AlertRules([AlertRule("reward_collapse", threshold=0.5, window=4)])
    # best 4-step mean is 0.8; the mean over steps 7..10 is (0.8 + 0 + 0 + 0) / 4 = 0.2 < 0.4 at step 10,
    # step 9 has (0.8 + 0.8 + 0 + 0) / 4 = 0.4, not below 0.4
    series = [figures(i, 0.8) for i in range(1, 8)] + [figures(i, 0.0) for i in range(8, 13)]
    assert fired(rules, series) == [("reward_collapse", 10)]


def test_reward_collapse_needs_a_level_to_fall_from():
    rules = AlertRules([AlertRule("reward_collapse", threshold=0.5, window=2)])
    assert fired(rules, [figures(i, 0.01) for i in range(1, 5)] + [figures(5, 0.0), figures(6, 0.0)]) == []


def test_reward_errors_fire_and_rearm():
    rules = AlertRules([AlertRule("reward_errors", threshold=0.1, window=2)])
    series = [figures(1, errors=0.0), figures(2, errors=0.3), figures(3, errors=0.3),  # mean 0.15, 0.3: fire at 2
              figures(4, errors=0.0), figures(5, errors=0.0),  # clears at 5 (mean 0)
              figures(6, errors=0.5)]  # mean 0.25: fires again
    assert fired(rules, series) == [("reward_errors", 2), ("reward_errors", 6)]


def test_the_reward_error_rate_is_over_the_windows_samples_and_its_counts_are_stated():
    rules = AlertRules([AlertRule("reward_errors", threshold=0.2, window=2)])
    # one step's 10 samples all errors, the next's 90 none: 10 of 100 (0.1), not the steps' mean rate 0.5
    assert fired(rules, [figures(1, errors=1.0, scored=10), figures(2, errors=0.0, scored=90)]) == []
    alert, = rules.check(figures(3, errors=0.5, scored=90))
    assert alert.message == "reward errors on 45 of 180 samples scored over the last 2 steps: rate 0.25, limit 0.2"


def test_queue_backlog_fires_only_when_large_and_growing():
    rules = AlertRules([AlertRule("queue_backlog", threshold=100, window=3)])
    series = [figures(1, queue=150), figures(2, queue=150), figures(3, queue=150),  # large, flat
              figures(4, queue=200)]  # window 150, 150, 200: growing
    assert fired(rules, series) == [("queue_backlog", 4)]


def test_no_progress_fires_between_steps_and_rearms_after_a_step():
    rules = AlertRules([AlertRule("no_progress", threshold=1.0, window=1)])
    assert rules.check_stall(3, seconds_since_progress=30) == []
    assert [a.kind for a in rules.check_stall(3, seconds_since_progress=61)] == ["no_progress"]
    assert rules.check_stall(3, seconds_since_progress=90) == []  # still firing: no repeat
    assert rules.check(figures(4)) == []  # a step clears it
    assert [a.step for a in rules.check_stall(4, seconds_since_progress=70)] == [4]
