"""Rollout capacity that comes and goes (`rollout.max_workers`), on the shared local cluster: a worker joins while
the cluster has room for one, and when it dies it leaves, its unsubmitted groups issued again and nothing lost.
Also `eval.enabled: false` (a tiny job's): no evaluator actor starts and the summary holds no accuracy."""

from __future__ import annotations

import json
import os
import signal

import pytest
import ray
from ray._private.state import state as ray_state

from rlplatform.config import RLConfig, load_config
from rlplatform.job.elastic import ElasticRollout
from rlplatform.job.placement import plan_job
from rlplatform.job.summaries import samples_unaccounted
from rlplatform.job.supervision import RestartDeadline, Supervisor
from rlplatform.job.workers import PolicyWorkers
from rlplatform.monitoring.watchdog import HangRule
from rlplatform.scheduling.groups import GroupSchedule
from rlplatform.scheduling.ledger import PromptLedger, balanced
from rlplatform.scheduling.staleness import StalenessRule
from rlplatform.transport.deadlines import Heartbeats, rollout_worker_label
from rlplatform.transport.redis_server import connect

from tests.job.conftest import actor_pid



@pytest.mark.slow
def test_a_worker_joins_where_the_cluster_has_room_and_its_death_loses_nothing(ray_session, tiny_job, run_files):
    # the job runs until the test has seen all it needs, then is stopped (SIGINT): a job of fixed length could end
    # before a worker started on a loaded machine is alive
    config = tiny_job("elastic", "rl.max_steps=100000", "rollout.max_workers=2")
    added = "elastic-policy-rollout-2"  # index 1 is the evaluator's, which a job without evaluation does not start
    watched_after_it_left = []

    def kill_the_added_worker_while_it_holds_groups_then_stop() -> None:
        try:
            ledger = PromptLedger(connect(run_files.redis_url(config.run_dir)), run_files.run(config), "policy")
            holds = lambda index: index in {value.decode() for value in ledger.client.hvals(ledger.claimed)}  # noqa: E731
            pid = actor_pid(added)
            while True:  # stopped while it holds groups it has not submitted, then killed
                run_files.wait_for(lambda: holds("2"), poll_s=0.01)
                os.kill(pid, signal.SIGSTOP)
                if holds("2"):
                    break
                os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
            run_files.wait_for(lambda: holds("3"), poll_s=0.05)  # its replacement works (it joined after the leave)
            left = rollout_worker_label(2, "policy")
            beats = Heartbeats(ledger.client, run_files.run(config)).beats()
            watched_after_it_left.extend(beat.worker for beat in beats if beat.worker == left)
        finally:
            os.kill(os.getpid(), signal.SIGINT)

    summary = run_files.run_job_while(config, kill_the_added_worker_while_it_holds_groups_then_stop)
    rl = summary["rl"]
    assert summary["status"] == "interrupted" and rl["ended_by"] == "stop", summary
    assert rl["steps"] > 0 and rl["samples_trained"] == rl["steps"] * 2 * 4
    # it left once, and (the cluster having room again) another took its place
    assert rl["rollout_workers_left"] == 1 and rl["rollout_workers_joined"] == 2, rl
    assert rl["ledger"]["abandoned"] == rl["ledger"]["reissued"] == rl["rollout_groups_reissued"] > 0
    assert balanced(rl["ledger"]) and rl["ledger"]["trained"] == rl["steps"] * 2
    assert samples_unaccounted(rl) == 0, rl
    assert rl["restarts"]["rollout"] == 0  # a worker that leaves is not a restart
    assert watched_after_it_left == []  # the watchdog would find it hung, its node gone
    events = [json.loads(line) for line in open(f"{config.run_dir}/events.jsonl")]
    said = [event["message"] for event in events if event["kind"] == "rollout_capacity"]
    assert [message.split(" ")[2] for message in said] == ["policy-2", "policy-2", "policy-3"] and \
        said[1].startswith("rollout worker policy-2 left") and "joined" in said[0] and "joined" in said[2], said

    names = {actor.get("Name") for actor in ray_state.actor_table(None).values()}
    assert {"elastic-policy-rollout-0", added, "elastic-policy-rollout-3"} <= names
    assert "elastic-policy-rollout-1" not in names  # no evaluator
    assert summary["eval"] == {} and rl["restarts"]["evaluator"] == 0


@ray.remote(resources={"a_resource_no_node_has": 1}, max_restarts=0)
class Unplaceable:
    def run(self) -> None:
        pass


def test_a_worker_that_was_never_placed_is_cancelled_at_the_end_instead_of_waited_for(ray_session, redis_client):
    """The room seen on a node was taken before Ray placed the added worker: at the stage's end it is killed and
    leaves, and the end does not wait out its end deadline for a loop that never ran."""
    config = load_config(None, ["rollout.max_workers=2"])
    plan = plan_job(config, ray.cluster_resources(), cuda_here=False).of("policy")
    fixed = [None]  # the policy's one worker started with the job, which plays no part here
    workers = PolicyWorkers(plan, None, fixed, None, None, keys=None, sft_rows=[], data={},
                            add_rollout=lambda index, node_id: Unplaceable.remote())
    supervisor = Supervisor(lambda text: None, RestartDeadline(HangRule(factor=10, floor_s=60)))
    notes = []
    heartbeats = Heartbeats(redis_client, "elastic-run")
    schedule = GroupSchedule(redis_client, "elastic-run", "policy", StalenessRule.of(RLConfig()))
    elastic = ElasticRollout("elastic", workers, schedule, supervisor.start, notes.append, heartbeats=heartbeats)
    elastic.room = {}  # any node has room for it, as the cluster looked a moment before another actor took it
    elastic.check()
    assert elastic.joined == 1 and len(workers.rollout) == 2
    heartbeats.beat(rollout_worker_label(2, "policy"), "generating")  # as a worker that ran would have
    elastic.cancel_pending()
    supervisor.wait_ended("rollout", timeout_s=30)
    assert elastic.left == 1 and len(workers.rollout) == 1 and notes[-1].startswith("rollout worker policy-2 left")
    assert heartbeats.beats() == []  # a worker that left is no longer watched
