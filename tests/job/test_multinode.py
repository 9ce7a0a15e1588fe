"""A job on a real Ray cluster of nodes started with `ray start` on this machine.

The second node declares a custom resource; the job joins the cluster through `ray.address`,
its rollout and reward workers ask for that resource (`rollout.resources`,
`reward_workers.resources`) and so run on the second node, a standalone `rlp reward-worker`
serves the same queue from outside Ray; a third node joins and leaves while the job runs (elastic rollout
workers: `rollout.max_workers`), then `rlp rollout-worker` attaches a worker by the job's name on a node it names
until it is stopped, and the job accounts for every sample as a local run does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from rlplatform.job.local_nodes import ENV, LocalNodes
from rlplatform.job.run_dir import RUN_ID
from rlplatform.job.summaries import samples_unaccounted
from rlplatform.scheduling.ledger import balanced
from rlplatform.transport.deadlines import Heartbeats
from rlplatform.transport.redis_server import connect
from rlplatform.transport.keys import run_scope
from tests.processes import RLP



class TwoNodeCluster(LocalNodes):
    """A head and a second node labelled `rollout_node`."""

    def start(self) -> None:
        self.start_head(cpus=2)
        self.add_node(cpus=2, resources={"rollout_node": 3})

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


@pytest.fixture
def cluster():
    two_nodes = TwoNodeCluster()
    try:
        two_nodes.start()
        yield two_nodes
    finally:
        two_nodes.stop()


def job_yaml(tmp_path: Path, name: str, address: str, **sections: dict) -> Path:
    """A tiny RL-only job joining `address`, its rollout and reward workers asking for `rollout_node`, its actors
    forked from each node's warm interpreter (the nodes share this machine's paths); `sections` update its sections."""
    job = {"name": name, "output_dir": str(tmp_path), "ray": {"address": address, "warm_start": True},
           "model": {"hidden_size": 64, "num_layers": 2, "intermediate_size": 128},
           "data": {"train_size": 300, "test_size": 8}, "sft": {"enabled": False}, "eval": {"batch_size": 8},
           "rl": {"max_steps": 6, "batch_prompts": 2, "group_size": 4, "max_new_tokens": 4},
           "rollout": {"prompts_per_batch": 4, "num_cpus": 0.5, "resources": {"rollout_node": 1}},
           "reward_workers": {"num_cpus": 0.25, "resources": {"rollout_node": 1}},
           "learner": {"num_cpus": 0.5}, "wandb": {"mode": "disabled"}}
    for section, values in sections.items():
        job[section].update(values)
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


def said(run_dir: Path, kind: str) -> list:
    path = run_dir / "events.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [event["message"] for event in events if event["kind"] == kind]


@pytest.mark.slow
def test_a_job_on_labelled_nodes_that_come_and_go_accounts_for_every_sample(cluster, tmp_path, run_files):
    """The labelled node holds the job's rollout worker, evaluator and reward worker (its 3 `rollout_node`), beside a
    standalone `rlp reward-worker` serving the same queue from outside Ray. A second labelled node joining mid-run
    has room for one more rollout worker, which joins there (the job allows 2: `rollout.max_workers`); then that node
    goes away, its worker's unsubmitted groups issued again. `rlp rollout-worker --job NAME` then attaches a worker
    on the node it names (asked without one, it is told that two nodes share this machine's address) until a Ctrl-C
    detaches it, its unsubmitted groups issued again; a stop ends the job with every sample accounted for. (What an
    added node adds to trained samples/s is measured by benchmarks/elastic.py, each node on a core of its own.)"""
    name = "multinode"
    run_dir = tmp_path / name
    watcher = cluster.watch_actors(until=run_dir / "summary.json")
    path = job_yaml(tmp_path, name, cluster.address, rl={"max_steps": 100_000}, rollout={"max_workers": 2})
    job = subprocess.Popen([RLP, "run", str(path)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started = [watcher, job]
    try:
        redis_url = wait_for_file(run_dir / "redis.url", job)
        standalone = subprocess.Popen([RLP, "reward-worker", "--redis", redis_url, "--job", name], env=ENV,
                                      stderr=subprocess.PIPE, text=True)
        started.append(standalone)
        run_files.wait_for(lambda: run_files.trained_steps(str(run_dir)) >= 3, timeout_s=180)
        core = max(os.sched_getaffinity(0))  # the node's processes on one core of their own
        node = cluster.add_node(cpus=1, resources={"rollout_node": 1}, on_cpus=[core])
        run_files.wait_for(lambda: said(run_dir, "rollout_capacity"), timeout_s=180)
        beats = Heartbeats(connect(redis_url), run_scope(name, (run_dir / RUN_ID).read_text().strip()))
        added_beat = []
        run_files.wait_for(lambda: added_beat.extend(
            beat for beat in beats.beats() if beat.worker == "rollout worker 2 of policy 'policy'"
            and beat.version is not None and beat.version >= 0 and beat.action == "generating") or added_beat,
            timeout_s=180)  # it holds weights and decodes
        assert psutil.Process(added_beat[0].pid).cpu_affinity() == [core]
        cluster.remove_node(node)
        run_files.wait_for(lambda: len(said(run_dir, "rollout_capacity")) == 2, timeout_s=180)
        # a worker attached by the job's name from a node of its cluster, for as long as its command runs: the two
        # nodes left share this machine's address, so the command is told to name one
        ask = [RLP, "rollout-worker", "--redis", redis_url, "--job", name]
        refused = subprocess.run(ask, env=ENV, capture_output=True, text=True, timeout=120)
        assert refused.returncode == 1 and "2 nodes of the job's Ray cluster run at " in refused.stderr, refused.stderr
        node_id = refused.stderr.split("(one of ")[1].split(",")[0]
        attach_file = tmp_path / "attach.log"
        with attach_file.open("w") as log:
            attached = subprocess.Popen([*ask, "--node-id", node_id], env=ENV, stderr=log, text=True)
        started.append(attached)
        run_files.wait_for(lambda: any(beat.worker == "rollout worker 3 of policy 'policy'" and beat.version is not None
                                       and beat.action == "generating" for beat in beats.beats()), timeout_s=180)
        run_files.wait_for(lambda: "rlp: attached" in attach_file.read_text(), timeout_s=60)  # its next poll says so
        attached.send_signal(signal.SIGINT)  # Ctrl-C: the job stops the worker, its unsubmitted groups issued again
        attached.wait(timeout=60)
        attach_log = attach_file.read_text()
        assert attached.returncode == 0, attach_log
        run_files.wait_for(lambda: len(said(run_dir, "rollout_capacity")) == 5, timeout_s=180)
        job.send_signal(signal.SIGTERM)
        output, _ = job.communicate(timeout=300)
        assert job.returncode == 143, output[-3000:]
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
    assert len({placed[actor] for actor in workers}) == 1 and placed[workers[0]] in labelled, placed
    added = f"{name}-policy-rollout-2"
    assert placed[added] not in {node for actor, node in placed.items() if actor != added}, placed  # the new node
    joined, left, refusal, attach, detach = said(run_dir, "rollout_capacity")
    assert joined.startswith("rollout worker policy-2 joined") and left.startswith("rollout worker policy-2 left")
    assert refusal.startswith("attach request ") and "give --node-id" in refusal
    assert attach.startswith(f"rollout worker policy-3 attached on node {node_id[:12]} by `rlp rollout-worker`")
    assert detach.startswith("rollout worker policy-3 left (its `rlp rollout-worker` ended)")
    assert placed[f"{name}-policy-rollout-3"] == node_id  # on the node its command named
    assert f"attached {name}-policy-rollout-3;" in attach_log and "rlp: detached" in attach_log

    summary = json.loads((run_dir / "summary.json").read_text())
    rl = summary["rl"]
    assert summary["status"] == "interrupted" and rl["samples_trained"] == rl["steps"] * 2 * 4
    assert samples_unaccounted(rl) == 0, rl
    assert rl["samples_unused_at_end"] == sum(rl["samples_unused_where"].values())
    assert rl["ledger"]["trained"] == rl["steps"] * 2 and balanced(rl["ledger"])
    assert rl["ledger"]["abandoned"] == rl["rollout_groups_reissued"]
    assert rl["rollout_workers_joined"] == rl["rollout_workers_left"] == 2
    assert rl["restarts"] == {"rollout": 0, "reward": 0, "evaluator": 0}  # a worker that leaves is not a restart
