"""Heartbeats under a running job: its rollout and reward workers and a standalone `rlp reward-worker`
all beat; the standalone one, stopped with SIGSTOP, is named once in an alert (console and event
log) and in `rlp status`, while the job's own reward worker takes over the requests it held. When it
is the job's only reward worker, the stalled reward queue is named within `monitoring.scoring_stall_s`,
long before the worker's silence, and training goes on once it continues."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path

from rlplatform.job.controller import run_job
from rlplatform.transport.deadlines import Heartbeats
from rlplatform.transport.redis_server import connect
from tests.processes import RLP



def _status(url: str, job: str) -> str:
    shown = subprocess.run([RLP, "status", "--redis", url, "--job", job], capture_output=True, text=True,
                           timeout=60, env=dict(os.environ, RAY_ADDRESS=""))
    return shown.stdout


def _alerts(run_dir: str, kind: str = "worker_silent") -> list:
    path = Path(run_dir) / "events.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [event["message"] for event in map(json.loads, lines) if event["kind"] == kind]


def test_a_stopped_standalone_reward_worker_is_named_in_an_alert_and_rlp_status(ray_session, tiny_job, run_files):
    config = tiny_job("quiet", "rl.max_steps=100000", "reward_workers.claim_idle_s=2", "monitoring.worker_silent_s=4")
    stuck = "reward worker outside"
    seen = {}

    def stop_a_worker_and_watch():
        url = run_files.redis_url(config.run_dir)
        worker = subprocess.Popen([RLP, "reward-worker", "--redis", url, "--job", config.name, "--name", "outside"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            beating = Heartbeats(connect(url), run_files.run(config))
            run_files.wait_for(lambda: {stuck, "reward worker quiet-reward-0", "rollout worker 0 of policy 'policy'"}
                               <= set(beating.silent(-1e9)))
            worker.send_signal(signal.SIGSTOP)  # alive, holding its requests, and making no progress
            run_files.wait_for(lambda: _alerts(config.run_dir), timeout_s=60)
            run_files.wait_for(lambda: f"silent_workers {stuck} (" in _status(url, config.name), timeout_s=30)
            seen["trained_then"] = run_files.trained_steps(config.run_dir)
            run_files.wait_for(lambda: run_files.trained_steps(config.run_dir) > seen["trained_then"])
        finally:
            worker.kill()
            worker.wait()
            os.kill(os.getpid(), signal.SIGTERM)  # the job stops as it would on SIGTERM
    thread = threading.Thread(target=stop_a_worker_and_watch, daemon=True)
    thread.start()
    summary = run_job(config)
    thread.join()
    assert summary["status"] == "interrupted" and "trained_then" in seen
    named = [alert for alert in _alerts(config.run_dir) if alert.startswith(stuck)]
    assert len(named) == 1 and named[0].startswith(f"{stuck} made no progress for ")


def test_a_stalled_reward_queue_is_named_before_its_only_worker_goes_silent(ray_session, tiny_job, run_files,
                                                                           tmp_path):
    config = tiny_job("stall", "rl.max_steps=100000", "reward_workers.num_workers=0", "monitoring.scoring_stall_s=4",
                      "monitoring.worker_silent_s=600")
    seen = {}
    worker_log = tmp_path / "reward-worker.log"  # what the worker said, for a failure's message

    def stop_the_worker_then_let_it_go():
        url = run_files.redis_url(config.run_dir)
        worker = subprocess.Popen([RLP, "reward-worker", "--redis", url, "--job", config.name, "--name", "only"],
                                  stdout=subprocess.DEVNULL, stderr=worker_log.open("w"))
        try:
            run_files.wait_for(lambda: worker.poll() is not None or run_files.trained_steps(config.run_dir) >= 1)
            if worker.poll() is not None:  # it could not serve: the job is stopped at once, the log says why
                return
            worker.send_signal(signal.SIGSTOP)
            run_files.wait_for(lambda: _alerts(config.run_dir, "scoring_stalled"), timeout_s=60)
            seen["trained_then"] = run_files.trained_steps(config.run_dir)
            worker.send_signal(signal.SIGCONT)
            run_files.wait_for(lambda: run_files.trained_steps(config.run_dir) > seen["trained_then"] + 1)
        finally:
            worker.kill()
            worker.wait()
            os.kill(os.getpid(), signal.SIGTERM)
    thread = threading.Thread(target=stop_the_worker_then_let_it_go, daemon=True)
    thread.start()
    summary = run_job(config)
    thread.join()
    assert summary["status"] == "interrupted" and "trained_then" in seen, worker_log.read_text()[-3000:]
    stalled = _alerts(config.run_dir, "scoring_stalled")
    assert len(stalled) == 1 and stalled[0].startswith("the reward queue (") and "scored nothing for" in stalled[0]
    assert "a reward call runs up to its timeout (exact_match 30s)" in stalled[0]  # slow calls stall it too
    assert "reward worker only " in stalled[0] and not _alerts(config.run_dir)  # named by its beat, not yet silent
