"""A run directory belongs to one live job, and an earlier run's work is never deleted: a second `rlp run`
of a live job's name refuses in one line before it writes anything (the lock dies with its holder,
SIGKILL included); a start that does not resume refuses where checkpoints lie, and `--fresh` moves
them aside."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rlplatform.config import ConfigError
from rlplatform.job.checkpoint import latest_checkpoint
from rlplatform.job.controller import run_job
from rlplatform.job.run_dir import RunLock
from tests.job.conftest import TINY
from tests.processes import RLP

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")
HOLD = "import sys, time\nfrom rlplatform.job.run_dir import RunLock\nRunLock(sys.argv[1]).__enter__()\n" \
       "print('held', flush=True)\ntime.sleep(120)\n"


def rlp_run(tmp_path, name: str, *extra: str, overrides=()) -> subprocess.CompletedProcess:
    return subprocess.run([RLP, "run", *extra, QUICKSTART, f"output_dir={tmp_path}", f"name={name}", *TINY,
                           *overrides],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, RAY_ADDRESS=""))


def earlier_run(run_dir: str) -> str:
    """What a stopped run leaves: its config, summary and a checkpoint."""
    checkpoint = os.path.join(run_dir, "checkpoints", "step-000004")
    os.makedirs(checkpoint)
    Path(checkpoint, "state.json").write_text(json.dumps({"attempt": 0}))
    for name in ("config.yaml", "summary.json"):
        Path(run_dir, name).write_text(f"the earlier run's {name}\n")
    return checkpoint


def test_a_second_run_of_a_live_jobs_name_refuses_in_one_line_and_writes_nothing(tmp_path):
    run_dir = str(tmp_path / "live")
    earlier_run(run_dir)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, run_dir], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        second = rlp_run(tmp_path, "live", "--fresh")  # even asked to move the earlier run aside: it is live
        assert second.returncode == 2
        assert second.stderr.strip().count("\n") == 0 and f"in use by a running job (pid {holder.pid})" in second.stderr
        assert Path(run_dir, "config.yaml").read_text() == "the earlier run's config.yaml\n"
        assert Path(run_dir, "summary.json").read_text() == "the earlier run's summary.json\n"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with RunLock(run_dir):  # the kernel let go of a killed holder's lock
        pass


def test_checkpoints_of_an_earlier_run_stop_a_fresh_start_in_one_line(tmp_path):
    run_dir = str(tmp_path / "again")
    checkpoint = earlier_run(run_dir)
    refused = rlp_run(tmp_path, "again")
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0
    assert "--resume" in refused.stderr and "--fresh" in refused.stderr and "step-000004" in refused.stderr
    assert latest_checkpoint(run_dir) == checkpoint  # nothing deleted


def test_fresh_moves_the_earlier_run_aside_and_starts_anew(ray_session, tiny_job):
    config = tiny_job("moved", "rl.max_steps=2")
    checkpoint = earlier_run(config.run_dir)
    with pytest.raises(ConfigError, match="--fresh"):
        run_job(config)
    summary = run_job(config, fresh=True)
    assert summary["status"] == "completed" and summary["rl"]["steps"] == 2
    (moved,) = glob.glob(config.run_dir + ".moved-*")
    assert os.path.isfile(os.path.join(moved, "checkpoints", "step-000004", "state.json"))
    assert Path(moved, "summary.json").read_text() == "the earlier run's summary.json\n"
    assert not os.path.exists(checkpoint)  # the new run's own checkpoint is the only one left
    assert latest_checkpoint(config.run_dir).endswith("step-000002")


def test_a_same_name_run_beside_a_live_job_on_a_shared_redis_refuses_in_one_line(redis_server, redis_client,
                                                                                   tmp_path):
    from rlplatform.transport.job_lease import JobLease
    from rlplatform.transport.keys import run_scope
    from rlplatform.transport.reward_queue import RewardQueue

    live = RewardQueue(redis_client, run_scope("shared", "a1"))
    with JobLease(redis_client, "shared", "a1", "/elsewhere/runs/shared"):  # a live job of the name, run elsewhere
        live.client.xadd(live.keys.requests, {"sample": b"in flight"})
        second = rlp_run(tmp_path, "shared", overrides=[f"redis.url={redis_server}"])
        assert second.returncode == 2 and second.stderr.strip().count("\n") == 0
        assert "a job named 'shared' is running on this Redis" in second.stderr and "/elsewhere" in second.stderr
        assert redis_client.xlen(live.keys.requests) == 1  # nothing of the live job was touched
        assert not os.path.exists(tmp_path / "shared")  # nor anything written for the refused one


def test_the_redis_url_file_is_read_whole_or_not_at_all(tmp_path):
    """Workers and `rlp status` read `redis.url` as soon as it exists: each write of it is whole, owner-only, and
    replaces the one before (a reader racing the writes never reads an empty or half-written URL)."""
    import threading

    from rlplatform.job.controller import record_redis_url

    path = tmp_path / "redis.url"
    path.write_text("left by an earlier attempt\n")
    path.chmod(0o644)
    urls = [f"redis://:{'p' * 32}{i:04d}@127.0.0.1:{40000 + i}/0" for i in range(400)]
    read, done = [], threading.Event()

    def reader() -> None:
        while not done.is_set():
            read.append(path.read_text())
    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for url in urls:
            record_redis_url(url, str(tmp_path))
    finally:
        done.set()
        thread.join()
    whole = {"left by an earlier attempt\n", *(url + "\n" for url in urls)}
    assert len(read) > 100 and all(text in whole for text in read), [text for text in read if text not in whole][:3]
    assert path.read_text() == urls[-1] + "\n" and path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["redis.url"]  # nothing partial left beside it
