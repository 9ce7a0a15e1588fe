"""The reward error guard by hand: the step window and the time window stop only when full and above
the limit, the time window alerts once at half, and every message names the window's first error."""

from __future__ import annotations

from rlplatform.config import MonitoringConfig
from rlplatform.monitoring.error_guard import RewardErrorGuard
from rlplatform.transport.samples import ResultMeta

LIMIT = MonitoringConfig(max_error_fraction=0.5, error_window=3, error_window_s=10.0)


def result(error=None) -> ResultMeta:
    return ResultMeta("g/0", "g", "policy", 0, 3, completion_tokens=2, reward=0.0, components={}, error=error)


def score(guard: RewardErrorGuard, ok: int, failed: int, error: str = "exact_match: KeyError: 'answer'") -> None:
    for _ in range(ok):
        guard.scored(result())
    for _ in range(failed):
        guard.scored(result(error))


def test_the_step_window_stops_once_full_and_above_the_limit():
    guard = RewardErrorGuard(LIMIT, min_samples=4, now=0.0)
    score(guard, ok=1, failed=3, error="code_tests: TimeoutError: 30 s")
    assert guard.stepped() is None  # 1 of 3 steps
    score(guard, ok=2, failed=2)
    assert guard.stepped() is None  # 2 of 3
    score(guard, ok=2, failed=2)
    verdict = guard.stepped()  # 7 errors of 12 over 3 steps: 0.58 > 0.5
    assert verdict.kind == "stop" and "7 of 12 samples" in verdict.message and "last 3 learner steps" in verdict.message
    assert verdict.message.endswith("first error: code_tests: TimeoutError: 30 s")
    score(guard, ok=4, failed=0)
    assert guard.stepped() is None  # the oldest step left the window: 4 of 12


def test_exactly_at_the_limit_does_not_stop():
    guard = RewardErrorGuard(LIMIT, min_samples=4, now=0.0)
    for _ in range(3):
        score(guard, ok=2, failed=2)
        verdict = guard.stepped()
    assert verdict is None


def test_the_time_window_alerts_once_at_half_then_stops_when_full():
    guard = RewardErrorGuard(LIMIT, min_samples=4, now=100.0)
    score(guard, ok=0, failed=3)
    assert guard.waiting(103.0) is None  # 3 samples: fewer than one batch
    score(guard, ok=0, failed=3)
    alert = guard.waiting(106.0)
    assert alert.kind == "alert" and "6 of 6 samples" in alert.message and "stops if this lasts 10 s" in alert.message
    score(guard, ok=1, failed=3)
    assert guard.waiting(108.0) is None  # alerted already
    score(guard, ok=0, failed=3)
    stop = guard.waiting(110.5)  # the window covers 100.5 .. 110.5: all four periods
    assert stop.kind == "stop" and "12 of 13 samples" in stop.message and "last 10 s" in stop.message


def test_the_time_window_slides_and_forgets_old_errors():
    guard = RewardErrorGuard(LIMIT, min_samples=4, now=0.0)
    score(guard, ok=0, failed=8)
    guard.waiting(2.0)
    score(guard, ok=8, failed=0)
    assert guard.waiting(11.0) is None  # 8 of 16: not above 0.5
    score(guard, ok=8, failed=0)
    assert guard.waiting(13.0) is None  # the failing period (ended at 2 s) left the window
    assert [p[1][1] for p in guard.periods] == [0, 0]


def test_a_job_without_errors_never_alerts():
    guard = RewardErrorGuard(MonitoringConfig(), min_samples=8, now=0.0)
    for second in range(1, 400):
        score(guard, ok=5, failed=0)
        assert guard.waiting(float(second)) is None
        assert guard.stepped() is None
