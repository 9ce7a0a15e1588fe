"""A job whose reward always raises stops within its error window, checkpointed, with one line naming
the reward and its error, and its summary keeps the RL counters; an alert came first."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from rlplatform.config import RewardSpec
from rlplatform.job.checkpoint import latest_checkpoint
from rlplatform.job.controller import run_job
from rlplatform.job.summaries import samples_unaccounted
from rlplatform.transport.deadlines import JobFailed


def test_a_reward_that_always_raises_stops_the_job_within_its_window(ray_session, tiny_job):
    config = tiny_job("broken-reward", "rl.max_steps=100000", "monitoring.error_window_s=6")
    config.rewards = [RewardSpec(fn="tests.job.rewards_for_tests:always_raises")]
    watchdog = threading.Timer(120.0, os.kill, (os.getpid(), signal.SIGTERM))  # without the guard it never ends
    watchdog.start()
    try:
        with pytest.raises(JobFailed) as failed:
            run_job(config)
    finally:
        watchdog.cancel()
    message = str(failed.value)
    assert "\n" not in message
    assert "above monitoring.max_error_fraction 0.9" in message and "last 6 s" in message
    assert "first error: always_raises: " in message and "the grader is unreachable" in message
    assert f"rlp run --resume {config.run_dir}" in message and latest_checkpoint(config.run_dir) is not None
    summary = json.loads((Path(config.run_dir) / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["wall_s"] < 120
    rl = summary["rl"]  # the counters as they stood, balanced
    assert rl["ended_by"] == "failed" and rl["reward_errors"] > 0
    assert samples_unaccounted(rl) == 0, rl
    events = [json.loads(line) for line in (Path(config.run_dir) / "events.jsonl").read_text().splitlines()]
    kinds = [event["kind"] for event in events]
    assert kinds.index("reward_errors_alert") < kinds.index("reward_errors_stop")
    assert {event["stage"] for event in events} == {"rl"}  # before RL's first step too, they are RL's
