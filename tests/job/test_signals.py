"""SIGTERM to the whole process group of a real `rlp run`, as Slurm and Kubernetes send it: the job
checkpoints, writes an `interrupted` summary and exits 143, leaving no process of its session (Ray's
included), no embedded redis-server and no temp folder behind; a second signal ends it at once, still
with a summary. Ray has nothing to warn about: no actor's constructor arguments sit in the object store. While it
trains, its actors run at the CPU priorities the config sets."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import pytest
import yaml

from tests.processes import RLP, alive, session

pytestmark = pytest.mark.slow

# far more than the job trains before the signal: at eval.priority idle the evaluator runs on the CPU time other
# processes leave, and beside a busy test its first evaluation came after 200 steps (about 10 s) had trained
MAX_STEPS = 5000
TINY = {"name": "sigterm", "model": {"hidden_size": 64, "num_layers": 2, "intermediate_size": 128},
        "data": {"train_size": 300, "test_size": 8}, "sft": {"enabled": False}, "eval": {"batch_size": 8},
        "rl": {"max_steps": MAX_STEPS, "batch_prompts": 2, "group_size": 4, "max_new_tokens": 4},
        "rollout": {"prompts_per_batch": 4, "num_cpus": 0.5}, "learner": {"num_cpus": 0.5},
        "reward_workers": {"num_cpus": 0.25}, "wandb": {"mode": "offline"}}


def _start(tmp_path: Path, temp: str, niceness: int = 0) -> subprocess.Popen:
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({**TINY, "output_dir": str(tmp_path)}))
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "TMPDIR": temp, "RAY_ADDRESS": ""}
    log = open(tmp_path / "log.txt", "w")
    return subprocess.Popen(["nice", "-n", str(niceness), RLP, "run", str(tmp_path / "job.yaml")], stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)  # its own group, as a batch
    # system starts it; `nice` execs rlp, so the job's process is the group leader


def _cpu_priorities(sid: int) -> dict:
    """The nicenesses of the processes of session `sid`, by their title's actor class
    (`ray::RolloutWorker.run` -> RolloutWorker), or `rlp` for the job's own process."""
    found: dict = {}
    for pid, _ in session(sid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        kind = "rlp" if RLP.encode() in argv[:2] else \
            argv[0].decode()[len("ray::"):].split(".")[0] if argv[0].startswith(b"ray::") else None
        if kind:
            found.setdefault(kind, set()).add(os.getpriority(os.PRIO_PROCESS, pid))
    return found


def _checkpointed(log: Path) -> bool:
    """Whether the job noted a checkpoint (with `checkpoint.every_steps` 0: the one the RL loop saves on a stop)."""
    return any(line.startswith("checkpoint ") for line in log.read_text().splitlines())


def _signal_group(job: subprocess.Popen, tmp_path: Path, run_files, signals: int, priorities: Optional[dict] = None):
    """Send SIGTERM `signals` times to the job's whole group once it trained a step, each after the one before
    was handled (the RL loop stopped and saved its checkpoint); (exit code, redis pid).
    `priorities` gets the job's processes' CPU priorities (`_cpu_priorities`) just before."""
    run_dir, log = tmp_path / "sigterm", tmp_path / "log.txt"
    try:
        run_files.wait_for(lambda: run_files.trained_steps(str(run_dir)) >= 1, timeout_s=300)
        redis_pid, redis_dir = run_files.redis_server(run_dir)
        if priorities is not None:  # once the evaluator, started after the learner, has evaluated the start
            run_files.wait_for(lambda: "eval policy before_rl" in log.read_text(), timeout_s=300)
            priorities.update(_cpu_priorities(job.pid))
        for sent in range(signals):
            if sent:
                run_files.wait_for(lambda: _checkpointed(log), timeout_s=120, poll_s=0.05)
            os.killpg(job.pid, signal.SIGTERM)
        return job.wait(timeout=300), redis_pid, redis_dir
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


def test_sigterm_to_the_group_checkpoints_summarises_and_stops_every_child(tmp_path, run_files):
    temp = tempfile.mkdtemp(prefix="t", dir="/tmp")  # short: Ray's socket paths must fit
    job = _start(tmp_path, temp, niceness=2)  # a job started below the default priority, as `nice rlp run`
    priorities: dict = {}
    code, redis_pid, redis_dir = _signal_group(job, tmp_path, run_files, signals=1, priorities=priorities)
    log_text = (tmp_path / "log.txt").read_text()
    assert code == 143, log_text[-3000:]
    # while it trained: learner ranks at the job's own niceness (not Ray's 15), rollout and reward workers
    # 4 levels below (rollout.priority, reward_workers.priority: low), the evaluator at 19 (eval.priority: idle)
    nice = min(os.getpriority(os.PRIO_PROCESS, 0) + 2, 19)
    assert priorities["rlp"] == priorities["LearnerRank"] == {nice}, priorities
    assert priorities["RewardWorker"] == {min(nice + 4, 19)}, priorities
    assert priorities["RolloutWorker"] == {min(nice + 4, 19)}, priorities
    assert priorities["EvaluatorWorker"] == {19}, priorities
    run_dir = tmp_path / "sigterm"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["exit_code"] == 143
    steps = summary["rl"]["steps"]
    assert 1 <= steps < MAX_STEPS
    assert (run_dir / "checkpoints" / f"step-{steps:06d}" / "state.json").exists()
    assert not alive(redis_pid) and not os.path.exists(redis_dir)
    run_files.wait_for(lambda: session(job.pid) == [], timeout_s=30)  # Ray's workers exit once their raylet is gone
    assert [p for p in os.listdir(temp) if p.startswith("rlp-")] == []
    # the signal reached the job alone: Ray's raylet did not shut itself down on it before the job was done
    raylet_logs = Path(temp).glob("ray/session_*/logs/raylet.out")
    assert not [log for log in raylet_logs if "received SIGTERM" in log.read_text()]
    assert "Traceback" not in log_text
    assert "constructor arguments in the object store" not in log_text  # nothing a restart could lose


def test_a_second_sigterm_to_the_group_ends_at_once_still_with_a_summary(tmp_path, run_files):
    temp = tempfile.mkdtemp(prefix="t", dir="/tmp")
    job = _start(tmp_path, temp)
    code, redis_pid, _ = _signal_group(job, tmp_path, run_files, signals=2)
    log_text = (tmp_path / "log.txt").read_text()
    # 143: the job's own exit; -SIGTERM: the second signal met Ray's shutdown, the job's last act, which
    # puts SIGTERM's default back beneath Python (the summary and Redis are done by then)
    assert code in (143, -signal.SIGTERM), log_text[-3000:]
    summary = json.loads((tmp_path / "sigterm" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["exit_code"] == 143
    assert not alive(redis_pid)
    try:
        run_files.wait_for(lambda: session(job.pid) == [], timeout_s=30)
    except TimeoutError:
        raise AssertionError(f"left running: {session(job.pid)}") from None
