"""A job on a real two-node Ray cluster started with `ray start` on this machine.

The second node declares a custom resource; the job joins the cluster through `ray.address`,
its rollout and reward workers ask for that resource (`rollout.resources`,
`reward_workers.resources`) and so run on the second node, a standalone `rlp reward-worker`
serves the same queue from outside Ray, and the job accounts for every sample as a local run does.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import yaml

from rlplatform.scheduling.ledger import balanced

RLP = str(Path(sys.executable).parent / "rlp")
RAY = [sys.executable, "-m", "ray.scripts.scripts"]
ENV = dict(os.environ, RAY_AUTH_MODE="token", RAY_ADDRESS="", WANDB_MODE="disabled")  # Ray heads require the token


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class TwoNodeCluster:
    """A head (`ray start --head --block`) and a second node labelled `rollout_node`, each on ports of
    its own under a temp dir of its own; `stop` ends only the processes these two commands started."""

    def __init__(self) -> None:
        self.temp_dir = tempfile.mkdtemp(prefix="rlp-ray-", dir="/tmp")  # short: Ray's socket paths live under it
        self.address = f"127.0.0.1:{free_port()}"
        self.nodes: list = []

    def start(self) -> None:
        port = self.address.rsplit(":", 1)[1]
        self._start("--head", f"--port={port}", "--num-cpus=2", "--include-dashboard=false",
                    f"--dashboard-port={free_port()}", f"--ray-client-server-port={free_port()}")
        self._start(f"--address={self.address}", "--num-cpus=2", "--resources", json.dumps({"rollout_node": 4}))

    def _start(self, *args: str, attempts: int = 2) -> None:
        """One `ray start --block`, returning once its node runs (the command says so, then blocks).
        A node that timed out registering (an overloaded machine) is started once more."""
        for attempt in range(attempts):
            log = Path(self.temp_dir, f"ray-start-{len(self.nodes)}-{attempt}.log")
            node = subprocess.Popen(
                [*RAY, "start", "--block", *args, f"--temp-dir={self.temp_dir}", "--object-store-memory=100000000",
                 f"--dashboard-agent-listen-port={free_port()}", "--disable-usage-stats"],
                env=ENV, stdout=log.open("w"), stderr=subprocess.STDOUT)
            while "block forever" not in log.read_text() and node.poll() is None:
                time.sleep(0.2)
            if node.poll() is None:
                self.nodes.append(node)
                return
        pytest.fail(f"`ray start {' '.join(args)}` failed:\n{log.read_text()}")

    def watch_actors(self, until: Path) -> subprocess.Popen:
        """A driver on the cluster that records, until `until` exists, the node of every named actor it sees
        placed (Ray's actor table: alive, or dead after it ran), then prints {"actors": {name: node id}, "labelled": [node ids]} as JSON."""
        script = f"""
import json, os, time, ray
from ray._private.state import actors
ray.init(address={self.address!r}, log_to_driver=False)
seen = {{}}
while not os.path.exists({str(until)!r}):
    seen.update({{a["Name"]: a["Address"]["NodeID"] for a in actors().values()
                 if a["Name"] and a["State"] in ("ALIVE", "DEAD") and a["Address"]["NodeID"]}})
    time.sleep(0.2)
labelled = [n["NodeID"] for n in ray.nodes() if "rollout_node" in n["Resources"]]
print(json.dumps({{"actors": seen, "labelled": labelled}}))
"""
        return subprocess.Popen([sys.executable, "-c", script], env=ENV, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.send_signal(signal.SIGTERM)  # `ray start --block` stops its node's processes on SIGTERM
        for node in reversed(self.nodes):
            try:
                node.wait(timeout=60)
            except subprocess.TimeoutExpired:
                node.kill()
        for process in psutil.process_iter(["cmdline"]):  # anything of theirs still alive (by our temp dir)
            if any(self.temp_dir in part for part in process.info["cmdline"] or []):
                process.kill()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


@pytest.fixture
def cluster():
    two_nodes = TwoNodeCluster()
    try:
        two_nodes.start()
        yield two_nodes
    finally:
        two_nodes.stop()


def job_yaml(tmp_path: Path, name: str, address: str) -> Path:
    """A tiny RL-only job joining `address`, its rollout and reward workers asking for `rollout_node`."""
    job = {"name": name, "output_dir": str(tmp_path), "ray": {"address": address},
           "model": {"hidden_size": 64, "num_layers": 2, "intermediate_size": 128},
           "data": {"train_size": 300, "test_size": 8}, "sft": {"enabled": False}, "eval": {"batch_size": 8},
           "rl": {"max_steps": 6, "batch_prompts": 2, "group_size": 4, "max_new_tokens": 4},
           "rollout": {"prompts_per_batch": 4, "num_cpus": 0.5, "resources": {"rollout_node": 1}},
           "reward_workers": {"num_cpus": 0.25, "resources": {"rollout_node": 1}},
           "learner": {"num_cpus": 0.5}, "wandb": {"mode": "disabled"}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def wait_for_file(path: Path, job: subprocess.Popen, timeout_s: float = 120.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert job.poll() is None, f"the job exited with {job.returncode} before writing {path.name}"
        assert time.monotonic() < deadline, f"no {path} after {timeout_s:.0f} s"
        time.sleep(0.2)
    return path.read_text().strip()


@pytest.mark.slow
def test_workers_run_on_the_labelled_node_and_the_job_accounts_for_every_sample(cluster, tmp_path):
    name = "multinode"
    watcher = cluster.watch_actors(until=tmp_path / name / "summary.json")
    job = subprocess.Popen([RLP, "run", str(job_yaml(tmp_path, name, cluster.address))], env=ENV,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started = [watcher, job]
    try:
        redis_url = wait_for_file(tmp_path / name / "redis.url", job)
        standalone = subprocess.Popen([RLP, "reward-worker", "--redis", redis_url, "--job", name], env=ENV,
                                      stderr=subprocess.PIPE, text=True)
        started.append(standalone)
        output, _ = job.communicate(timeout=300)
        assert job.returncode == 0, output
        _, worker_log = standalone.communicate(timeout=60)
        assert standalone.returncode == 0, worker_log
        seen, errors = watcher.communicate(timeout=120)
        assert watcher.returncode == 0, errors
    finally:
        for process in started:
            process.kill()  # only those still running: a finished one ignores it
    assert int(worker_log.split("scored ")[1].split(" samples")[0]) > 0  # it served beside the Ray reward worker
    placement = json.loads(seen.strip().splitlines()[-1])
    placed, labelled = placement["actors"], placement["labelled"]
    workers = [f"{name}-policy-rollout-0", f"{name}-policy-rollout-1", f"{name}-reward-0"]  # rollout-1: the evaluator
    assert len(labelled) == 1 and {placed[actor] for actor in workers} == set(labelled), placed

    summary = json.loads((tmp_path / name / "summary.json").read_text())
    rl = summary["rl"]
    assert summary["status"] == "completed" and rl["samples_trained"] == 6 * 2 * 4
    assert rl["samples_generated"] == (rl["samples_trained"] + rl["samples_dropped_stale"]
                                       + rl["samples_dropped_error"] + rl["samples_dropped_zero_advantage"]
                                       + rl["samples_dropped_invalid"] + rl["samples_unused_at_end"])
    assert rl["samples_unused_at_end"] == sum(rl["samples_unused_where"].values())
    assert rl["ledger"]["trained"] == 6 * 2 and balanced(rl["ledger"])
    assert rl["restarts"] == {"rollout": 0, "reward": 0, "evaluator": 0}
