"""A job whose Redis stops answering (SIGSTOPped: alive, holding its connections, silent) ends within its
`redis.reconnect_s` with one line naming the Redis and the checkpoint it wrote from the learner's memory;
summary.json keeps the RL counters, balanced as a completed job's are; resumed (with a fresh Redis), the job
trains on to its last step and no sample is trained twice."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from rlplatform.job.checkpoint import latest_checkpoint, read_state
from rlplatform.job.controller import run_job
from rlplatform.transport.deadlines import JobFailed


def test_a_job_whose_redis_stalls_checkpoints_from_the_learner_and_resumes(ray_session, tiny_job, run_files):
    config = tiny_job("lost-redis", "rl.max_steps=100000", "redis.reconnect_s=3", "resume=auto")
    stalled = {}

    def stall_redis():
        run_files.wait_for(lambda: run_files.trained_steps(config.run_dir) >= 3)
        stalled["pid"], _ = run_files.redis_server(config.run_dir)
        os.kill(stalled["pid"], signal.SIGSTOP)
        stalled["steps"] = run_files.trained_steps(config.run_dir)
    thread = threading.Thread(target=stall_redis, daemon=True)
    thread.start()
    with pytest.raises(JobFailed) as failed:
        run_job(config)
    thread.join()
    message = str(failed.value)
    assert "\n" not in message and "went away" in message and "(no reconnect within 3s)" in message
    checkpoint = latest_checkpoint(config.run_dir)  # no periodic checkpoints: this one is the failure's
    assert checkpoint is not None and f"checkpoint {checkpoint} written from the learner's memory" in message
    assert f"rlp run --resume {config.run_dir}" in message

    summary = json.loads((Path(config.run_dir) / "summary.json").read_text())
    rl = summary["rl"]
    assert summary["status"] == "failed" and "\x1b" not in summary["error"] and rl["ended_by"] == "failed"
    steps = rl["steps"]
    assert steps >= stalled["steps"] and read_state(checkpoint)["policies"]["policy"]["version"] == steps
    assert rl["samples_trained"] == steps * 2 * 4 == len(run_files.trained_ids(config.run_dir))
    assert rl["samples_generated"] == (rl["samples_trained"] + rl["samples_dropped_stale"]
                                       + rl["samples_dropped_error"] + rl["samples_dropped_zero_advantage"]
                                       + rl["samples_dropped_invalid"] + rl["samples_abandoned_at_resume"]
                                       + rl["samples_unused_at_end"])
    assert set(rl["samples_unused_where"]) == {"in_flight_at_failure"}

    config.rl.max_steps = steps + 3
    resumed = run_job(config)  # the stalled server was stopped with the job: a fresh one serves the resume
    assert resumed["status"] == "completed" and resumed["rl"]["steps"] == steps + 3
    ids = run_files.trained_ids(config.run_dir)
    assert len(ids) == len(set(ids)) == (steps + 3) * 2 * 4
    assert resumed["rl"]["samples_trained"] == (steps + 3) * 2 * 4
