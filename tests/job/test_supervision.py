"""Workers dying under a running job (SIGKILLed rollout, reward and evaluation workers: see
test_faults.py): a sample lost to dead letters expires its group instead of deadlocking the job,
and its prompt is issued again; a learner rank's death ends the job with a message naming how to
resume; a SIGKILLed worker counts one restart however long Ray takes to restart it."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import pytest
import ray

from rlplatform.job.checkpoint import latest_checkpoint
from rlplatform.job.controller import run_job
from rlplatform.job.summaries import samples_unaccounted
from rlplatform.config import EvalConfig
from rlplatform.job.supervision import RestartDeadline, Supervisor
from rlplatform.job.workers import Evaluator
from rlplatform.rewards.worker import RewardWorker
from rlplatform.monitoring.watchdog import HangRule
from rlplatform.transport.deadlines import JobFailed, WorkerHung
from rlplatform.scheduling.ledger import balanced
from rlplatform.transport.redis_server import connect
from rlplatform.transport.reward_queue import RewardQueue
from tests.job.stand_ins import AnsweringEvaluator, EndsOnceRestarted, SlowToBuildEvaluator, SlowToStart


RESTART = RestartDeadline(HangRule(factor=10, floor_s=60))  # a worker's restart: the defaults' floor


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


def test_a_dead_worker_not_back_within_its_restart_deadline_hangs_the_job(ray_session):
    """The deadline is the hang rule's on the workers' measured start-up: here 1 x 1 s, against a restart that takes
    over 2 s."""
    actor = SlowToStart.remote()
    supervisor = Supervisor(lambda text: None, RestartDeadline(HangRule(factor=1, floor_s=0.5), start_s=1.0))
    supervisor.start("rollout", "slow", actor)
    os.kill(ray.get(actor.pid.remote()), signal.SIGKILL)
    deadline = time.monotonic() + 60
    with pytest.raises(WorkerHung, match=r"rollout worker slow died and was not back within 1s \(its restart "):
        while time.monotonic() < deadline:
            supervisor.check()
            time.sleep(0.05)
    ray.kill(actor)


def _answers(actor, not_pid: int) -> bool:
    try:
        return ray.get(actor.pid.remote(), timeout=1) != not_pid
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
        return False


def test_a_killed_worker_counts_one_restart_and_its_loop_runs_again(ray_session):
    actor = SlowToStart.remote()
    pid = ray.get(actor.pid.remote())
    supervisor = Supervisor(lambda text: None, RESTART)
    supervisor.start("rollout", "slow", actor)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while not _answers(actor, pid):  # the supervisor checks its loops all along, as the RL loop does
        assert time.monotonic() < deadline
        for _ in range(10):
            supervisor.check()
            time.sleep(0.02)
    loop = supervisor._loops[0]
    while loop.revival is not None or not supervisor.restarts["rollout"]:  # its loop is called again
        assert time.monotonic() < deadline
        supervisor.check()
        time.sleep(0.02)
    assert _answers(actor, pid)  # the restarted process runs the loop's new call: nothing is left to fail
    supervisor.check()
    assert supervisor.restarts["rollout"] == 1
    assert not ray.wait([loop.ref], timeout=0)[0]  # its loop was called again and runs
    ray.kill(actor, no_restart=True)


def test_a_worker_that_dies_as_the_stage_ends_counts_one_restart_and_says_so(ray_session):
    actor = EndsOnceRestarted.remote()
    pid = ray.get(actor.pid.remote())
    notes = []
    supervisor = Supervisor(notes.append, RESTART)
    supervisor.start("rollout", "late", actor)
    os.kill(pid, signal.SIGKILL)  # before any check: its death is seen by the end's wait
    supervisor.wait_ended("rollout", timeout_s=60)
    assert supervisor.restarts["rollout"] == 1
    assert len(notes) == 1 and notes[0].startswith("rollout worker late died while the stage ended; restarting it")
    ray.kill(actor, no_restart=True)


@ray.remote(num_cpus=0)
def _construction_heard_late(actor, late_s: float) -> None:
    """Answers `late_s` after `actor` is constructed: its construction's answer, as a loaded driver may see it."""
    ray.get(actor.__ray_ready__.remote())
    time.sleep(late_s)


@pytest.mark.parametrize("heard_late", [False, True])
def test_an_evaluators_start_up_is_not_taken_for_a_hung_evaluation(ray_session, heard_late):
    """The first evaluation waits on the actor's construction, longer than an evaluation's deadline (2 s before
    any evaluation here): no hang; the construction is bounded by the restart deadline instead, and left out of
    the longest evaluation the deadline grows from, also when the construction's answer is seen after the
    evaluation's (`heard_late`: half a second after)."""
    hangs = []
    evaluator = Evaluator(SlowToBuildEvaluator.remote(4.0), [], EvalConfig(), [], [], on_restart=hangs.append,
                          restart=RESTART, hang_rule=HangRule(factor=2, floor_s=1), on_hang=hangs.append)
    if heard_late:
        evaluator._constructed = _construction_heard_late.remote(evaluator.actor, 0.5)
    assert evaluator.run_now() == (0, {"accuracy": 0.5})
    assert hangs == [] and evaluator.restarts == 0 and evaluator.longest_s < 2
    ray.kill(evaluator.actor, no_restart=True)


def _kill_and_wait(actor) -> None:
    pid = ray.get(actor.pid.remote())
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not _answers(actor, pid):
        assert time.monotonic() < deadline


@pytest.mark.parametrize("heard_before", [True, False])
def test_an_evaluator_restarted_between_evaluations_counts_one_restart_and_raises_its_alert(ray_session,
                                                                                            heard_before):
    alerts = []
    evaluator = Evaluator(AnsweringEvaluator.remote(), [], EvalConfig(), [], [], on_restart=alerts.append,
                          restart=RESTART)
    if heard_before:  # else Ray restarts it before its first answer
        assert evaluator.run_now() == (0, {"accuracy": 0.5})
    _kill_and_wait(evaluator.actor)
    for _ in range(3):  # no call fails: the restart is seen from the process that answers
        assert evaluator.run_now() == (0, {"accuracy": 0.5})
    assert evaluator.restarts == 1
    assert alerts == ["the evaluator was restarted between two evaluations"]
    ray.kill(evaluator.actor, no_restart=True)


def test_sample_lost_to_dead_letters_expires_its_group_instead_of_deadlocking(ray_session, tiny_job, run_files):
    # one reward worker, run here: the first request it reads goes to dead letters, so that
    # sample's group never completes; with max_staleness 0 the job could not go on without expiry
    config = tiny_job("lost", "rl.max_steps=3", "rl.max_staleness=0", "reward_workers.num_workers=0",
                      "rl.group_timeout_s=6")
    job_over = threading.Event()

    def serve_rewards():
        queue = RewardQueue(connect(run_files.redis_url(config.run_dir)), run_files.run(config))
        run_files.wait_for(lambda: queue.client.exists(queue.keys.rewards))
        taken = []
        run_files.wait_for(lambda: taken.extend(queue.fetch("dropper", 1, 100)) or taken)
        queue.dead_letter(taken[0][0], taken[0][1], "lost on purpose")
        try:
            RewardWorker("scorer", config.rewards, run_files.redis_url(config.run_dir), queue.keys.run,
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
    assert samples_unaccounted(rl) == 0, rl  # the expired group's samples in their own outcome, and in no other
    assert rl["ledger"]["expired"] == rl["groups_expired"] and balanced(rl["ledger"])
    assert rl["ledger"]["reissued"] >= 1  # the expired group's prompt was issued again
    assert rl["ledger"]["trained"] == 3 * 2


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


def test_a_weight_store_that_does_not_take_a_version_within_its_deadline_is_named(ray_session, redis_client):
    """The deadline of a publish is the job's rule on the longest one measured (`PolicyRun.publish_deadline_s`):
    a weight store past it (its process stopped) is named, and the version is not announced to the rollout
    workers."""
    from types import SimpleNamespace

    from rlplatform.job.workers import publish
    from rlplatform.transport.keys import PolicyKeys
    from rlplatform.transport.weight_store import WeightStoreActor
    from tests.job.conftest import actor_pid

    keys, name = PolicyKeys("run", "policy"), f"stuck-weights-{uuid.uuid4().hex[:6]}"
    store = WeightStoreActor.options(name=name).remote()
    workers = SimpleNamespace(name="policy", keys=keys, weight_store=store)  # what `publish` reads of PolicyWorkers
    publish(workers, redis_client, 1, ray.put({"w": 0}), deadline_s=60.0)
    assert int(redis_client.get(keys.version)) == 1
    pid = actor_pid(name)
    os.kill(pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(WorkerHung, match=r"the weight store of policy 'policy' did not answer for 2s"):
            publish(workers, redis_client, 2, ray.put({"w": 1}), deadline_s=2.0)
        assert time.monotonic() - started < 10
        assert int(redis_client.get(keys.version)) == 1  # version 2 was not announced
    finally:
        os.kill(pid, signal.SIGCONT)
        ray.kill(store)
