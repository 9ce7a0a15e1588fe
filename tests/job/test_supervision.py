"""Workers dying under a running job: rollout, reward and evaluation workers are restarted and
nothing is lost, their counts included; a sample lost to dead letters expires its group instead of deadlocking the job;
a learner rank's death ends the job with a message naming how to resume."""

from __future__ import annotations

import os
import threading

import pytest
import ray

from rlplatform.job.checkpoint import latest_checkpoint
from rlplatform.job.controller import run_job
from rlplatform.rewards.worker import RewardWorker
from rlplatform.transport.deadlines import JobFailed
from rlplatform.transport.ledger import balanced
from rlplatform.transport.redis_server import connect
from rlplatform.transport.reward_queue import RewardQueue


def _in_background(action):
    errors = []

    def run():
        try:
            action()
        except BaseException as err:  # surfaced by the test after the job
            errors.append(err)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


def test_killed_rollout_reward_and_eval_workers_restart_and_lose_nothing(ray_session, tiny_job, run_files):
    # max_staleness 0: one group lost for good would stall the job until its expiry, which
    # group_timeout_s puts past the test's patience; claim_idle_s is as long, so a reward request
    # left by the killed reward worker is only back in time if its restart takes it back
    config = tiny_job("killed", "rl.max_steps=6", "rl.max_staleness=0", "rollout.num_workers=2",
                      "reward_workers.num_workers=2", "reward_workers.claim_idle_s=600", "rl.group_timeout_s=600",
                      "eval.every_steps=1")

    def kill_workers():
        run_files.wait_for(lambda: run_files.trained_steps(config.run_dir) >= 1)
        for name in ("killed-policy-rollout-0", "killed-reward-0", "killed-policy-rollout-2"):
            ray.kill(ray.get_actor(name), no_restart=False)
    thread, errors = _in_background(kill_workers)
    summary = run_job(config)
    thread.join()
    assert not errors
    rl = summary["rl"]
    assert summary["status"] == "completed" and rl["steps"] == 6
    assert rl["restarts"]["rollout"] >= 1 and rl["restarts"]["reward"] >= 1
    assert rl["groups_expired"] == 0
    # the killed rollout worker's samples still count: every sample generated was scored or is left unscored
    unused = rl["samples_unused_where"]
    assert rl["samples_generated"] == rl["samples_scored"] + unused["scored_unread"] + unused["unscored"]
    ids = run_files.trained_ids(config.run_dir)
    assert len(ids) == len(set(ids)) == 6 * 2 * 4
    ledger = rl["ledger"]
    assert ledger["trained"] == 6 * 2 and balanced(ledger)
    assert 0.0 <= summary["eval"]["after_rl"]["accuracy"] <= 1.0


def test_sample_lost_to_dead_letters_expires_its_group_instead_of_deadlocking(ray_session, tiny_job, run_files):
    # one reward worker, run here: the first request it reads goes to dead letters, so that
    # sample's group never completes; with max_staleness 0 the job could not go on without expiry
    config = tiny_job("lost", "rl.max_steps=3", "rl.max_staleness=0", "reward_workers.num_workers=0",
                      "rl.group_timeout_s=15")
    job_over = threading.Event()

    def serve_rewards():
        queue = RewardQueue(connect(run_files.redis_url(config.run_dir)), config.name)
        run_files.wait_for(lambda: queue.rewards_json() is not None)
        taken = []
        run_files.wait_for(lambda: taken.extend(queue.fetch("dropper", 1, 100)) or taken)
        queue.dead_letter(taken[0][0], taken[0][1], "lost on purpose")
        try:
            RewardWorker("scorer", config.rewards, run_files.redis_url(config.run_dir), config.name,
                         config.reward_workers).run()
        except ConnectionError:
            assert job_over.is_set()  # Redis went away with the job
    thread, errors = _in_background(serve_rewards)
    summary = run_job(config)
    job_over.set()
    thread.join()
    assert not errors
    rl = summary["rl"]
    assert summary["status"] == "completed" and rl["steps"] == 3
    assert rl["groups_expired"] >= 1 and rl["samples_dropped_expired"] >= config.rl.group_size - 1
    assert rl["ledger"]["expired"] == rl["groups_expired"] and balanced(rl["ledger"])
    assert rl["ledger"]["trained"] == 3 * 2
    # trained and expired samples' results were deleted from Redis: only the untrained ones are left
    unused = rl["samples_unused_where"]
    assert rl["results_held_at_end"] == unused["in_buffer"] + unused["scored_unread"]


def test_learner_rank_death_ends_the_job_naming_the_checkpoint(ray_session, tiny_job, run_files):
    config = tiny_job("learner", "rl.max_steps=50", "checkpoint.every_steps=1")

    def kill_learner():
        run_files.wait_for(lambda: latest_checkpoint(config.run_dir) is not None)  # one to resume from
        ray.kill(ray.get_actor("learner-policy-learner-0"))
    thread, errors = _in_background(kill_learner)
    with pytest.raises(JobFailed) as failure:
        run_job(config)
    thread.join()
    assert not errors
    message = str(failure.value)
    assert message.startswith("a learner rank died") and "\n" not in message
    assert f"rlp run --resume {config.run_dir}" in message
    assert os.path.join(config.run_dir, "checkpoints", "step-") in message
