"""A bridge-only job (`rollout.source: bridge`): its rollout workers generate nothing of their own, and
with no agent calling, the stage ends by `rl.idle_timeout_s` with counts that balance."""

from __future__ import annotations

import os
import signal
import threading

from rlplatform.job.controller import run_job


def test_a_bridge_only_job_generates_nothing_itself_and_ends_when_idle(ray_session, tiny_job):
    config = tiny_job("bridge-only", "rl.max_steps=100000", "rollout.source=bridge", "rl.idle_timeout_s=5",
                      "rollout.openai_bridge.enabled=true", "rollout.openai_bridge.port=0")
    watchdog = threading.Timer(120.0, os.kill, (os.getpid(), signal.SIGTERM))  # were it never idle
    watchdog.start()
    try:
        summary = run_job(config)
    finally:
        watchdog.cancel()
    rl = summary["rl"]
    assert summary["status"] == "completed" and rl["ended_by"] == "idle_timeout"
    assert rl["samples_generated"] == 0 and rl["steps"] == 0 and rl["ledger"]["issued"] == 0
    assert rl["wall_s"] < 60
