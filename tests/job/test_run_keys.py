"""A run's Redis keys are its own: a later run of the same name on the same Redis leaves an earlier run's keys
as they were (a queue left by a run killed outright, a finished run's status), `rlp status` shows the newest
run, and a resumed run keeps its run id, so a worker serving it before the resume serves it after."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from rlplatform.cli import main
from rlplatform.job.controller import run_job
from rlplatform.rewards.worker import RewardWorker
from rlplatform.transport.job_lease import newest_run
from rlplatform.transport.keys import JobKeys, run_scope
from rlplatform.transport.reward_queue import RewardQueue

pytestmark = pytest.mark.slow


def test_a_later_run_of_a_name_leaves_the_earlier_runs_keys_and_a_resume_keeps_its_own(
        ray_session, tiny_job, redis_server, redis_client, tmp_path, run_files, capsys):
    shared = [f"redis.url={redis_server}", "rl.max_steps=2"]
    first = run_job(tiny_job("keys", *shared))
    earlier = JobKeys(run_scope("keys", first["run_id"]))
    redis_client.xadd(earlier.requests, {"data": b"left by a run killed outright"})
    earlier_keys = {key: redis_client.type(key) for key in redis_client.scan_iter(match=earlier.pattern)}
    assert redis_client.hget(earlier.status, "stage") == b"completed"

    second_config = tiny_job("keys", *shared, f"output_dir={tmp_path / 'elsewhere'}")
    second = run_job(second_config)
    assert second["status"] == "completed" and second["run_id"] != first["run_id"]
    assert {key: redis_client.type(key) for key in redis_client.scan_iter(match=earlier.pattern)} == earlier_keys
    assert redis_client.xlen(earlier.requests) == 1 and redis_client.hget(earlier.status, "stage") == b"completed"
    run = run_scope("keys", second["run_id"])
    assert newest_run(redis_client, "keys") == run
    capsys.readouterr()  # the jobs' console lines
    assert main(["status", "--redis", redis_server, "--job", "keys"]) == 0
    assert capsys.readouterr().out.startswith("keys: stage completed") and run_files.run(second_config) == run

    served, errors = threading.Event(), []

    def serve_the_run():  # bound to the run before it resumes, as a standalone worker would be
        try:
            queue = RewardQueue(redis_client, run)
            run_files.wait_for(lambda: queue.client.exists(queue.keys.rewards), timeout_s=120)
            served.set()
            RewardWorker("outside", second_config.rewards, redis_server, run, second_config.reward_workers).run()
        except BaseException as err:  # the resumed run published on other keys: end the job, report it
            errors.append(err)
            os.kill(os.getpid(), signal.SIGTERM)
    thread = threading.Thread(target=serve_the_run, daemon=True)
    thread.start()
    resumed = run_job(tiny_job("keys", *shared, f"output_dir={tmp_path / 'elsewhere'}", "rl.max_steps=4",
                               "resume=always", "reward_workers.num_workers=0"))
    thread.join(timeout=60)
    assert not errors and served.is_set()
    assert resumed["status"] == "completed" and resumed["rl"]["steps"] == 4 and resumed["run_id"] == second["run_id"]
    assert redis_client.xlen(earlier.requests) == 1  # still untouched
