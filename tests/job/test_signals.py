"""SIGTERM to a real `rlp run`: the job checkpoints, writes an `interrupted` summary, exits 143 and
leaves neither its embedded redis-server nor that server's temp folder behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

RLP = str(Path(sys.executable).parent / "rlp")
TINY = {"name": "sigterm", "model": {"hidden_size": 64, "num_layers": 2, "intermediate_size": 128},
        "data": {"train_size": 300, "test_size": 8}, "sft": {"enabled": False}, "eval": {"batch_size": 8},
        "rl": {"max_steps": 200, "batch_prompts": 2, "group_size": 4, "max_new_tokens": 4},
        "rollout": {"prompts_per_batch": 4, "num_cpus": 0.5}, "learner": {"num_cpus": 0.5},
        "reward_workers": {"num_cpus": 0.25}, "wandb": {"mode": "offline"}}


def _redis_child(run_dir: Path):
    """(pid, temp folder) of the embedded redis-server serving the job, found by its port."""
    port = (run_dir / "redis.url").read_text().strip().rsplit(":", 1)[1].split("/")[0]
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"redis-server" in argv[0] and argv[0].strip().endswith(f":{port}".encode()):  # its process title
            return int(entry.name), os.readlink(entry / "cwd")  # it runs in its --dir
    raise AssertionError(f"no redis-server on port {port}")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return False
    return state != "Z"


def test_sigterm_checkpoints_summarises_and_stops_every_child(tmp_path, run_files):
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({**TINY, "output_dir": str(tmp_path)}))
    run_dir = tmp_path / "sigterm"
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    with open(tmp_path / "log.txt", "w") as log:
        job = subprocess.Popen([RLP, "run", str(tmp_path / "job.yaml")], stdout=log, stderr=subprocess.STDOUT,
                               env=env)
        try:
            run_files.wait_for(lambda: run_files.trained_steps(str(run_dir)) >= 1, timeout_s=300)
            redis_pid, redis_dir = _redis_child(run_dir)
            job.send_signal(signal.SIGTERM)
            code = job.wait(timeout=300)
        finally:
            job.kill()
    log_text = (tmp_path / "log.txt").read_text()
    assert code == 143, log_text[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["exit_code"] == 143
    steps = summary["rl"]["steps"]
    assert 1 <= steps < 200
    assert (run_dir / "checkpoints" / f"step-{steps:06d}" / "state.json").exists()
    assert not _alive(redis_pid) and not os.path.exists(redis_dir)
    assert "Traceback" not in log_text
