"""A job that fails keeps its progress: whatever ends it, it checkpoints first and says where in one line, and
summary.json keeps the RL counters, balanced as a completed job's are.

- Its Redis stops answering (SIGSTOPped: alive, holding its connections, silent): the job ends within its
  `redis.reconnect_s`, naming the Redis and the checkpoint it wrote from the learner's memory; resumed (with a
  fresh Redis), it trains on to its last step and no sample is trained twice.
- An external Redis stalls the same way: the job ends as soon, naming it, with nothing of the server's to dump.
- A worker's loop ends on its own (its job's stop flag set from outside): the job checkpoints and names it.
- SIGINT while a reward call hangs: the job stops as on SIGTERM, checkpointed, within seconds, not when the
  call's timeout ends it."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from rlplatform.config import RewardSpec
from rlplatform.job.checkpoint import latest_checkpoint, read_state
from rlplatform.job.controller import run_job
from rlplatform.job.summaries import samples_unaccounted
from rlplatform.transport.deadlines import JobFailed
from rlplatform.transport.redis_server import EmbeddedRedis, connect
from rlplatform.transport.reward_queue import RewardQueue


def test_a_job_whose_redis_stalls_checkpoints_from_the_learner_and_resumes(ray_session, tiny_job, run_files):
    config = tiny_job("lost-redis", "rl.max_steps=100000", "redis.reconnect_s=3", "resume=auto")
    stalled = {}

    def stall_redis():
        run_files.wait_for(lambda: run_files.trained_steps(config.run_dir) >= 3)
        stalled["pid"], _ = run_files.redis_server(config.run_dir)
        os.kill(stalled["pid"], signal.SIGSTOP)
        stalled["steps"] = run_files.trained_steps(config.run_dir)
    with pytest.raises(JobFailed) as failed:
        run_files.run_job_while(config, stall_redis)
    message = str(failed.value)
    assert "\n" not in message and "went away" in message and "(no reconnect within 3s)" in message
    checkpoint = latest_checkpoint(config.run_dir)  # no periodic checkpoints: this one is the failure's
    assert checkpoint is not None and f"checkpoint {checkpoint} written from the learner's memory" in message
    assert f"rlp run --resume {config.run_dir}" in message
    # not Python: the stopped server's kernel state stands for its stack dump
    [dump] = Path(config.run_dir, "hangs").glob(f"redis-server-pid{stalled['pid']}-*.txt")
    assert message.endswith(f"its process (pid {stalled['pid']}) was T (stopped): state in {dump}")
    assert "State:\tT (stopped)" in dump.read_text()

    summary = json.loads((Path(config.run_dir) / "summary.json").read_text())
    rl = summary["rl"]
    assert summary["status"] == "failed" and "\x1b" not in summary["error"] and rl["ended_by"] == "failed"
    steps = rl["steps"]
    assert steps >= stalled["steps"] and read_state(checkpoint).policies["policy"].version == steps
    assert rl["samples_trained"] == steps * 2 * 4 == len(run_files.trained_ids(config.run_dir))
    assert samples_unaccounted(rl) == 0 and set(rl["samples_unused_where"]) == {"in_flight_at_failure"}

    config.rl.max_steps = steps + 3
    resumed = run_job(config)  # the stalled server was stopped with the job: a fresh one serves the resume
    assert resumed["status"] == "completed" and resumed["rl"]["steps"] == steps + 3
    ids = run_files.trained_ids(config.run_dir)
    assert len(ids) == len(set(ids)) == (steps + 3) * 2 * 4
    assert resumed["rl"]["samples_trained"] == (steps + 3) * 2 * 4
    # the groups of the steps that ended around the stall are closed in the checkpoint's ledger, so no prompt is
    # trained again (null: a group issued after the ledger's last mirrored read, whose position the job lost)
    lines = [json.loads(line) for line in Path(config.run_dir, "trained.jsonl").read_text().splitlines()]
    known = [p for line in lines for p in line["prompts"] if p is not None]
    assert len(known) == len(set(known))


def test_a_job_whose_external_redis_stalls_checkpoints_and_names_it(ray_session, tiny_job, run_files, tmp_path):
    """The operator's Redis, not the job's: nothing to restart or dump, so the job checkpoints and ends naming it
    within `redis.reconnect_s`, leaving the server as it found it."""
    with EmbeddedRedis(str(tmp_path / "external")) as server:
        config = tiny_job("lost-external-redis", "rl.max_steps=100000", "redis.reconnect_s=3",
                          f"redis.url={server.url}")

        def stall_redis():
            run_files.wait_for(lambda: run_files.trained_steps(config.run_dir) >= 3)
            os.kill(server.pid, signal.SIGSTOP)
        try:
            with pytest.raises(JobFailed) as failed:
                run_files.run_job_while(config, stall_redis)
        finally:
            os.kill(server.pid, signal.SIGCONT)
        message = str(failed.value)
        assert "\n" not in message and "went away" in message and "(no reconnect within 3s)" in message
        checkpoint = latest_checkpoint(config.run_dir)
        assert checkpoint is not None and f"checkpoint {checkpoint} written from the learner's memory" in message
        assert message.endswith(f"resume with `rlp run --resume {config.run_dir}` once it is back")
        assert not Path(config.run_dir, "hangs").exists()
        rl = json.loads((Path(config.run_dir) / "summary.json").read_text())["rl"]
        assert rl["ended_by"] == "failed" and samples_unaccounted(rl) == 0
        assert read_state(checkpoint).policies["policy"].version == rl["steps"]
        assert connect(server.url).ping()  # still the operator's


def test_a_worker_loop_that_ends_on_its_own_fails_the_job_checkpointed(ray_session, tiny_job, run_files):
    config = tiny_job("early-end", "rl.max_steps=100000")

    def stop_the_workers_behind_the_jobs_back():
        run_files.wait_for(lambda: run_files.trained_steps(config.run_dir) >= 3)
        RewardQueue(connect(run_files.redis_url(config.run_dir)), run_files.run(config)).request_stop()
    with pytest.raises(JobFailed) as failed:
        run_files.run_job_while(config, stop_the_workers_behind_the_jobs_back)
    message = str(failed.value)
    checkpoint = latest_checkpoint(config.run_dir)
    assert "\n" not in message and "stopped before the job asked it to" in message
    assert checkpoint is not None and f"(checkpoint {checkpoint})" in message
    summary = json.loads((Path(config.run_dir) / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["rl"]["ended_by"] == "failed"
    assert samples_unaccounted(summary["rl"]) == 0
    assert read_state(checkpoint).policies["policy"].version == summary["rl"]["steps"] >= 3


def test_sigint_while_a_reward_call_hangs_stops_the_job_within_seconds(ray_session, tiny_job, run_files):
    config = tiny_job("hung-reward", "rl.max_steps=100000", "rl.max_staleness=0")
    hanging = os.path.join(config.run_dir, "reward-hangs")
    config.rewards = [RewardSpec(fn="tests.job.rewards_for_tests:hangs_from_version_2", timeout_s=200.0,
                                 params={"hanging": hanging})]
    sent = {}

    def interrupt_once_the_reward_hangs():
        run_files.wait_for(lambda: os.path.exists(hanging))  # version 2's samples are in the reward's hanging calls
        sent["at"] = time.monotonic()
        os.kill(os.getpid(), signal.SIGINT)
    summary = run_files.run_job_while(config, interrupt_once_the_reward_hangs)
    ended_s = time.monotonic() - sent["at"]
    assert summary["status"] == "interrupted" and summary["exit_code"] == 130
    assert ended_s < 60, f"the job took {ended_s:.0f}s to stop; the reward call's timeout is 200s"
    assert summary["rl"]["steps"] == 2 and latest_checkpoint(config.run_dir).endswith("step-000002")
    assert samples_unaccounted(summary["rl"]) == 0
