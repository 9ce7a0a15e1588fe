"""The watchdog: beats say where each worker runs and what it does; a rollout worker or the evaluator stopped for
good is named in a `hang` alert with its pid, its stacks are dumped to the run's hangs/ folder and it is restarted,
the job completing with every sample accounted for (and its evaluations); a learner rank stopped for good ends
the job within its deadline in one line naming the rank and the dump, exit code 3, in RL and in SFT; a tool worker
stopped while the job waits on an evaluation outside RL is restarted by that wait. With
`monitoring.watchdog=false` each job test fails by its own deadline (the job never ends, and is stopped after
JOB_DEADLINE_S)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from rlplatform.job.rl_loop import end_deadline_s
from rlplatform.monitoring.job_status import format_beats
from rlplatform.monitoring.watchdog import HangRule, WorkerWatchdog, dump_stacks
from rlplatform.scheduling.ledger import balanced
from rlplatform.transport.deadlines import Beat, Heartbeats, JobFailed
from tests.job.conftest import EVAL, actor_pid

pytestmark = pytest.mark.slow

# deadlines a tiny job reaches in seconds: 10x the longest round or step (well under a second here), at least 3 s
FAST_WATCHDOG = ["monitoring.hang_floor_s=3", "monitoring.hang_factor=10"]
JOB_DEADLINE_S = 240.0  # the test's own: a job still running then is stopped, and the test fails (a slow CPU
# takes up to 100 s over a job that stops, dumps and restarts a worker)


def test_beats_say_where_a_worker_runs_what_it_does_and_its_longest_round(redis_client):
    heartbeats = Heartbeats(redis_client, "rlp:beats:run")
    heartbeats.beat("rollout worker 0 of policy 'p'", "generating", 3)
    time.sleep(0.3)
    heartbeats.beat("rollout worker 0 of policy 'p'", "loading weights v4", 3)  # a new action is written at once
    heartbeats.beat("reward worker w", "serving", round_limit_s=30.0)
    beats = {beat.worker: beat for beat in heartbeats.beats()}
    rollout = beats["rollout worker 0 of policy 'p'"]
    assert (rollout.pid, rollout.action, rollout.version) == (os.getpid(), "loading weights v4", 3)
    assert 0.3 <= rollout.longest_round_s < 5 and rollout.node_ip
    assert beats["reward worker w"].longest_round_s == 30.0  # a reward call may take its timeout
    lines = format_beats(list(beats.values()), time.time())
    assert lines[1].startswith(f"rollout worker 0 of policy 'p' (pid {os.getpid()} on {rollout.node_ip}, "
                               f"loading weights v4 at version 3): last progress 0s ago")


def test_at_the_stop_the_job_waits_for_workers_outside_ray_to_leave_within_their_rounds(redis_client):
    heartbeats = Heartbeats(redis_client, f"rlp:leaving-{uuid.uuid4().hex[:6]}:run")
    now = time.time()
    for worker, actor, round_s in (("reward worker slow", "", 0.0), ("reward worker gone", "", 0.0),
                                   ("rollout worker 0 of policy 'p'", "a1b2", 30.0)):
        redis_client.hset(heartbeats.key, worker, json.dumps({"at": now, "actor": actor, "longest_round_s": round_s}))
    threading.Timer(0.5, heartbeats.leave, ("reward worker slow",)).start()  # it saw the flag after its round
    started = time.monotonic()
    heartbeats.await_outside_workers()
    waited = time.monotonic() - started
    # the one that left was waited for; the one that never did, for twice its longest round (a beat's floor, 1 s);
    # a Ray actor (stopped by the job itself) not at all
    assert 1.5 < waited < 2.5 and "reward worker slow" not in {beat.worker for beat in heartbeats.beats()}
    redis_client.hset(heartbeats.key, "reward worker late", json.dumps({"at": now, "longest_round_s": 30.0}))
    heartbeats.leave("reward worker gone")
    threading.Timer(0.3, heartbeats.leave, ("reward worker late",)).start()
    started = time.monotonic()
    heartbeats.await_outside_workers()  # back once it left, long before its 60 s
    assert time.monotonic() - started < 5
    redis_client.hset(heartbeats.key, "reward worker killed", json.dumps({"at": time.time(), "longest_round_s": 30.0}))
    started = time.monotonic()
    heartbeats.await_outside_workers(within_s=0.5)  # a stop on a signal: not its 60 s
    assert 0.4 < time.monotonic() - started < 3


@pytest.fixture
def stopped_process():
    """A Python process whose main thread sleeps in `wait_here`, SIGSTOPped."""
    process = subprocess.Popen([sys.executable, "-c", "import time\ndef wait_here():\n    while True: time.sleep(0.05)"
                                                      "\nprint('ready', flush=True)\nwait_here()"],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    os.kill(process.pid, signal.SIGSTOP)
    yield process
    process.kill()
    process.wait()


def test_the_stage_end_gives_each_kind_of_worker_the_rule_on_its_longest_round():
    rule = HangRule(factor=10, floor_s=3)
    beats = [Beat("rollout worker 0 of policy 'p'", 1.0, longest_round_s=0.8),
             Beat("rollout worker 1 of policy 'p'", 1.0, longest_round_s=0.2), Beat("reward worker w", 1.0,
                                                                                   longest_round_s=2.0)]
    assert end_deadline_s(rule, beats, "rollout") == 8.0 and end_deadline_s(rule, beats, "reward") == 20.0
    assert end_deadline_s(rule, beats, "teacher") == 3.0  # none has beaten: the floor


def test_a_hung_workers_stacks_are_dumped_and_it_is_restarted_once_per_hang(stopped_process, tmp_path):
    restarted = []
    watchdog = WorkerWatchdog(HangRule(factor=10, floor_s=3), str(tmp_path), lambda actor: restarted.append(actor) or True)
    beat = Beat("rollout worker 0 of policy 'p'", at=100.0, pid=stopped_process.pid, node_ip="10.0.0.1",
                actor="ab12", action="generating", version=7, longest_round_s=0.5)
    assert watchdog.check([beat], now=104.0) == []  # 4 s silent: under 10 x 0.5 s
    [message] = watchdog.check([beat], now=106.0)
    assert message.startswith(f"rollout worker 0 of policy 'p' (pid {stopped_process.pid} on 10.0.0.1, generating at "
                              f"version 7) made no progress for 6s (deadline 5s") and restarted == ["ab12"]
    [dump] = list((tmp_path / "hangs").iterdir())
    assert f"stacks in {dump}" in message and "wait_here" in dump.read_text()  # read from the stopped process
    assert watchdog.check([beat], now=200.0) == []  # that hang is handled
    later = Beat(beat.worker, at=300.0, pid=stopped_process.pid, actor="ab12", longest_round_s=0.5)
    assert watchdog.check([later], now=309.0) == []  # its deadline doubled after the restart
    assert len(watchdog.check([later], now=311.0)) == 1 and restarted == ["ab12", "ab12"]


def test_a_stopped_process_on_another_node_is_dumped_by_a_task_there_or_says_why_not(ray_session, stopped_process,
                                                                                      tmp_path):
    said = dump_stacks(stopped_process.pid, "no-such-node", str(tmp_path / "d.txt"))
    assert said.startswith("no stack dump (") and not (tmp_path / "d.txt").exists()


def _job_with_stopped_actors(config, stops, run_files):
    """Run the job, SIGSTOPping for good each `(actor, when)` of `stops` in turn, once `when()` holds; a job still
    running after JOB_DEADLINE_S is stopped (SIGTERM; 20 s later the stopped processes are killed, ending a wait on
    them). Returns (summary or the error raised, the stopped pids)."""
    stopped = []

    def stop_them():
        for actor, when in stops:
            run_files.wait_for(when)
            stopped.append(actor_pid(actor))
            os.kill(stopped[-1], signal.SIGSTOP)
    deadlines = [threading.Timer(JOB_DEADLINE_S, os.kill, (os.getpid(), signal.SIGTERM)),
                 threading.Timer(JOB_DEADLINE_S + 20, lambda: [os.kill(pid, signal.SIGKILL) for pid in stopped])]
    for deadline in deadlines:
        deadline.start()
    try:
        result = run_files.run_job_while(config, stop_them)
    except JobFailed as err:
        result = err
    finally:
        for deadline in deadlines:
            deadline.cancel()
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    return result, stopped


def _after_steps(config, run_files, steps: int):
    return lambda: run_files.trained_steps(config.run_dir) >= steps


def _events(run_dir: str, kind: str):
    path = Path(run_dir, "events.jsonl")
    lines = path.read_text().splitlines() if path.exists() else []
    return [event for event in map(json.loads, lines) if event["kind"] == kind]


def test_a_learner_stopped_for_good_ends_the_job_in_one_line_naming_it_and_the_dump(ray_session, tiny_job, run_files):
    config = tiny_job("hung-learner", "rl.max_steps=200", "checkpoint.every_steps=2", *FAST_WATCHDOG)
    error, [pid] = _job_with_stopped_actors(
        config, [("hung-learner-policy-learner-0", _after_steps(config, run_files, 3))], run_files)
    summary = json.loads(Path(config.run_dir, "summary.json").read_text())
    assert isinstance(error, JobFailed) and summary["status"] == "failed", "the job never ended with its learner stopped"
    message = str(error)
    assert message.startswith("the learner hung: ") and " made no progress for " in message and "\n" not in message
    assert f"learner rank 0 of policy 'policy' (pid {pid} on " in message
    assert f"resume with `rlp run --resume {config.run_dir}` (checkpoint " in message
    [dump] = list(Path(config.run_dir, "hangs").iterdir())
    assert f"stacks in {dump}" in message and dump.read_text().strip()
    assert summary["exit_code"] == 3 and error.exit_code == 3 and _events(config.run_dir, "hang")
    assert summary["rl"]["ended_by"] == "failed" and summary["rl"]["samples_trained"] >= 3 * 2 * 4


def test_an_evaluator_stopped_for_good_is_named_dumped_and_restarted(ray_session, tiny_job, run_files):
    # two SFT steps: the job waits for their evaluation, so the evaluator is up before RL (without SFT it starts
    # beside RL, and on a loaded machine was up only after a 40-step stage ended); stopped at RL's first step, it is
    # waited for at the stage's end past hang_factor x its longest evaluation (at least hang_floor_s). The floor
    # covers the learner's SFT steps too: at 3 s a second step that took 3 s on a loaded machine (0.7 s for the
    # first) was taken for a hung learner
    config = tiny_job("hung-eval", "sft.enabled=true", "sft.steps=2", "rl.max_steps=40", *EVAL,
                      "eval.priority=normal", "monitoring.hang_floor_s=10", "monitoring.hang_factor=3")
    summary, [pid] = _job_with_stopped_actors(  # the evaluator
        config, [("hung-eval-policy-rollout-1", _after_steps(config, run_files, 1))], run_files)
    assert summary["status"] == "completed", "the job never ended with its evaluator stopped"
    [hang] = _events(config.run_dir, "hang")
    assert hang["message"].startswith(f"the evaluator (pid {pid} on ") and "restarting it" in hang["message"]
    [dump] = list(Path(config.run_dir, "hangs").iterdir())
    assert f"stacks in {dump}" in hang["message"] and dump.read_text().strip()
    assert summary["rl"]["restarts"]["evaluator"] == 1
    assert summary["eval"]["after_rl"]["policy_version"] == 40 and "after_sft" in summary["eval"]


TOOL_CALC = str(Path(__file__).resolve().parents[2] / "configs" / "tool_calc.yaml")


def test_a_tool_worker_then_a_rollout_worker_stopped_for_good_are_named_dumped_and_restarted(ray_session, tmp_path,
                                                                                            run_files):
    """One job, two hangs in turn. Tool workers serve from their construction, without a loop of the stage's: the
    watchdog restarts one whole, and the calls it held are taken back by its restart (every episode here calls the
    calculator). Then the only rollout worker, stopped mid-loop: restarted, its unsubmitted groups issued again; the
    job completes with every sample accounted for."""
    from rlplatform.config import load_config

    config = load_config(TOOL_CALC, [
        f"output_dir={tmp_path}", "name=hung-tool", "env.fn=tests.envs.tools_for_tests:CalculateThePrompt",
        "model.hidden_size=64", "model.num_layers=2", "model.intermediate_size=128", "sft.enabled=false",
        "eval.enabled=false", "rl.max_steps=30", "rl.batch_prompts=2", "rl.group_size=2", "rl.max_new_tokens=4",
        "env.max_tokens=40", "data.train_size=64", "data.test_size=8", "wandb.mode=disabled",
        "env.tool_workers.num_cpus=0.25", "env.tools[0].timeout_s=0.3", *FAST_WATCHDOG])  # deadline 3 s
    trained_at_tool_restart = []

    def tool_restarted_and_three_more_steps() -> bool:
        if not trained_at_tool_restart and _events(config.run_dir, "hang"):
            trained_at_tool_restart.append(run_files.trained_steps(config.run_dir))
        return bool(trained_at_tool_restart) and \
            run_files.trained_steps(config.run_dir) >= trained_at_tool_restart[0] + 3
    summary, [tool_pid, rollout_pid] = _job_with_stopped_actors(config, [
        ("hung-tool-tool-0", _after_steps(config, run_files, 3)),
        ("hung-tool-policy-rollout-0", tool_restarted_and_three_more_steps)], run_files)
    assert summary["status"] == "completed", "the job never ended with its tool worker, then its rollout worker stopped"
    tool, rollout = (event["message"] for event in _events(config.run_dir, "hang"))
    assert tool.startswith(f"tool worker hung-tool-tool-0 (pid {tool_pid} on ") and "restarting it" in tool
    assert rollout.startswith(f"rollout worker 0 of policy 'policy' (pid {rollout_pid} on ")
    assert ("generating" in rollout or "loading weights" in rollout) and "restarting it" in rollout
    dumps = list(Path(config.run_dir, "hangs").iterdir())
    [tool_dump] = [dump for dump in dumps if f"stacks in {dump}" in tool]
    [rollout_dump] = [dump for dump in dumps if f"stacks in {dump}" in rollout]
    assert len(dumps) == 2 and tool_dump.read_text().strip() and "rollout.py" in rollout_dump.read_text()
    rl = summary["rl"]
    assert rl["restarts"]["rollout"] == 1
    assert rl["steps"] == 30 and rl["samples_trained"] == 30 * 2 * 2 and balanced(rl["ledger"])
    assert rl["tools"]["calculator/calls"] >= 30 * 2 * 2


def test_in_sft_a_stopped_tool_worker_is_restarted_by_the_waiting_job_and_a_stopped_learner_ends_it(
        ray_session, tmp_path, run_files):
    """One job, two hangs in turn. Outside the RL loop (here SFT's held-out checks, as at a stage's final evaluation)
    the job waits on the evaluator while its episodes wait on the tool worker: the wait watches the tool workers, and
    restarts the hung one, instead of restarting the evaluator over and over; SFT goes on past its next check. Then
    the learner rank, stopped mid-SFT: the step's deadline (10x the longest step so far, at least 3 s) ends the job
    in one line naming the rank and its dump, exit code 3."""
    from rlplatform.config import load_config
    from rlplatform.job.run_dir import RUN_ID
    from rlplatform.monitoring.job_status import JobStatus
    from rlplatform.transport.keys import run_scope
    from rlplatform.transport.redis_server import connect

    config = load_config(TOOL_CALC, [
        f"output_dir={tmp_path}", "name=hung-sft-tool", "env.fn=tests.envs.tools_for_tests:CalculateThePrompt",
        "model.hidden_size=64", "model.num_layers=2", "model.intermediate_size=128", "rl.enabled=false",
        "sft.steps=1000", "sft.eval_every=40", "sft.stop_at_accuracy=0.99", "sft.batch_size=8", "eval.max_rows=8",
        "rl.max_new_tokens=4", "env.max_tokens=40", "data.train_size=64", "data.test_size=8", "wandb.mode=disabled",
        "env.tool_workers.num_cpus=0.25", "env.tools[0].timeout_s=0.3", *FAST_WATCHDOG])  # deadline 3 s

    def run_keys():
        run_id, url = Path(config.run_dir, RUN_ID), Path(config.run_dir, "redis.url")
        if not (run_id.exists() and url.exists()):
            return None
        return connect(url.read_text().strip()), run_scope(config.name, run_id.read_text().strip())

    def tool_serving() -> bool:
        keys = run_keys()
        return keys is not None and any(beat.worker.startswith("tool worker") for beat in Heartbeats(*keys).beats())

    def restarted_and_past_the_next_check() -> bool:  # the check at step 40 waited on the restarted tool worker
        status = JobStatus(*run_keys()).read()
        line = status.line if status is not None else None
        return bool(_events(config.run_dir, "hang")) and line is not None and line.stage == "sft" and \
            int(line.step.split("/")[0]) > 50
    error, [tool_pid, learner_pid] = _job_with_stopped_actors(config, [
        ("hung-sft-tool-tool-0", tool_serving),
        ("hung-sft-tool-policy-learner-0", restarted_and_past_the_next_check)], run_files)
    assert isinstance(error, JobFailed), "the job never ended with its tool worker, then its learner stopped"
    tool, learner = (event["message"] for event in _events(config.run_dir, "hang"))
    assert tool.startswith(f"tool worker hung-sft-tool-tool-0 (pid {tool_pid} on ")
    assert "restarting it" in tool and not _events(config.run_dir, "worker_restart")
    assert learner == str(error) and learner.startswith("the learner hung: an SFT step made no progress for ")
    assert f"learner rank 0 of policy 'policy' (pid {learner_pid} on " in learner and "\n" not in learner
    learner_dumps = [dump for dump in Path(config.run_dir, "hangs").iterdir() if f"stacks in {dump}" in learner]
    assert len(learner_dumps) == 1 and learner_dumps[0].read_text().strip()
    summary = json.loads(Path(config.run_dir, "summary.json").read_text())
    assert summary["status"] == "failed" and summary["exit_code"] == error.exit_code == 3
