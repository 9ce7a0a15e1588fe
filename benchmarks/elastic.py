"""Rollout capacity that comes and goes, measured where a node brings cores of its own: a Ray cluster of nodes
started with `ray start` on this machine, each pinned to its own CPUs. The head holds the whole job on one core
(`rlp run`, its Redis, the learner, the reward worker and one rollout worker); an elastic rollout worker
(`rollout.max_workers: 2`) joins whenever a node pinned to another core joins, and leaves with it. Trained
samples/s is measured before the node joins, while its worker generates, and after it left, for `--rounds` joins;
the job is then stopped and its summary must account for every sample (nothing lost or trained twice).

Usage: python benchmarks/elastic.py [--rounds 3] [--window-s 15] [--out benchmarks/results/elastic.md]
Needs 2 cores or more.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Dict, List

import yaml

from rlplatform.job.local_nodes import ENV, LocalNodes
from rlplatform.job.run_dir import RUN_ID
from rlplatform.job.summaries import samples_unaccounted
from rlplatform.scheduling.ledger import balanced
from rlplatform.transport.deadlines import Heartbeats, rollout_worker_label
from rlplatform.transport.keys import run_scope
from rlplatform.transport.redis_server import connect

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RLP = str(Path(sys.executable).parent / "rlp")
NAME = "elastic"
# a tiny policy whose RL is bound by generation: completions of up to 48 tokens, one decoding thread a worker
JOB = {"name": NAME, "model": {"hidden_size": 64, "num_layers": 2, "intermediate_size": 128},
       "data": {"train_size": 2000, "test_size": 8}, "sft": {"enabled": False}, "eval": {"enabled": False},
       "rl": {"max_steps": 1_000_000, "batch_prompts": 4, "group_size": 8, "max_new_tokens": 48},
       "rollout": {"num_workers": 1, "max_workers": 2, "num_cpus": 1, "num_threads": 1,
                   "resources": {"rollout_node": 1}},
       "reward_workers": {"num_cpus": 0.25}, "learner": {"num_cpus": 0.5, "num_threads": 1},
       "wandb": {"mode": "disabled"}}


def trained_samples(run_dir: Path) -> int:
    path = run_dir / "trained.jsonl"
    return sum(len(json.loads(line)["sample_ids"]) for line in path.read_text().splitlines()) if path.exists() else 0


def trained_per_s(run_dir: Path, window_s: float) -> float:
    """Trained samples a second over the next `window_s` seconds."""
    before, start = trained_samples(run_dir), time.monotonic()
    time.sleep(window_s)
    return (trained_samples(run_dir) - before) / (time.monotonic() - start)


def capacity_events(run_dir: Path) -> List[str]:
    path = run_dir / "events.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [event["message"] for event in events if event["kind"] == "rollout_capacity"]


def wait_for(condition: Callable[[], bool], what: str, job: subprocess.Popen, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if job.poll() is not None:
            raise RuntimeError(f"the job exited with {job.returncode} while waiting for {what} (its output: job.log)")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.2)


def measure(rounds: int, window_s: float, cores: List[int], out_dir: Path) -> Dict:
    """`cores`: the head's core, then the added node's."""
    head_core, node_core = cores
    nodes = LocalNodes()
    run_dir = out_dir / NAME
    job = None
    try:
        nodes.start_head(cpus=3, resources={"rollout_node": 1}, on_cpus=[head_core])
        config = out_dir / f"{NAME}.yaml"
        config.write_text(yaml.safe_dump({**JOB, "output_dir": str(out_dir), "ray": {"address": nodes.address}}))
        log = out_dir / "job.log"  # a file, not a pipe: a pipe nobody reads fills up and stops the job's prints
        job = subprocess.Popen([RLP, "run", str(config)], env=ENV, cwd=REPO, stdout=log.open("w"),
                               stderr=subprocess.STDOUT, preexec_fn=lambda: os.sched_setaffinity(0, [head_core]))
        wait_for(lambda: (run_dir / "trained.jsonl").exists() and trained_samples(run_dir) >= 20 * 32,
                 "20 trained steps", job)
        beats = Heartbeats(connect((run_dir / "redis.url").read_text().strip()),
                           run_scope(NAME, (run_dir / RUN_ID).read_text().strip()))
        rates = {"before": [trained_per_s(run_dir, window_s)], "with the node": [], "after": []}
        for joined in range(rounds):
            node = nodes.add_node(cpus=1, resources={"rollout_node": 1}, on_cpus=[node_core])
            wait_for(lambda: len(capacity_events(run_dir)) == 2 * joined + 1, "the added worker's join", job)
            index = int(capacity_events(run_dir)[-1].split()[2].rsplit("-", 1)[1])  # "rollout worker policy-<i> joined"
            added = rollout_worker_label(index, "policy")
            wait_for(lambda: any(beat.worker == added and beat.action == "generating" for beat in beats.beats()),
                     "the added worker generating", job)
            rates["with the node"].append(trained_per_s(run_dir, window_s))
            nodes.remove_node(node)
            wait_for(lambda: len(capacity_events(run_dir)) == 2 * joined + 2, "the added worker's leave", job)
            rates["after"].append(trained_per_s(run_dir, window_s))
        job.send_signal(signal.SIGTERM)
        if job.wait(timeout=300) != 143:
            raise RuntimeError(f"the job ended with {job.returncode}:\n{log.read_text()[-3000:]}")
    finally:
        if job is not None and job.poll() is None:
            job.kill()
        nodes.stop()
    rl = json.loads((run_dir / "summary.json").read_text())["rl"]
    return {"rates": rates, "rl": rl, "events": capacity_events(run_dir)}


def accounting(rl: Dict, trained_ids: List[str]) -> Dict[str, object]:
    return {"trained": rl["samples_trained"], "steps": rl["steps"], "unaccounted": samples_unaccounted(rl),
            "trained twice": len(trained_ids) - len(set(trained_ids)),
            "ledger balanced": balanced(rl["ledger"]), "groups issued again": rl["rollout_groups_reissued"],
            "joined": rl["rollout_workers_joined"], "left": rl["rollout_workers_left"]}


def report(result: Dict, args: argparse.Namespace, cores: List[int], run_dir: Path, wall_s: float) -> str:
    rates = result["rates"]
    ids = [i for line in (run_dir / "trained.jsonl").read_text().splitlines() for i in json.loads(line)["sample_ids"]]
    counts = accounting(result["rl"], ids)
    alone = rates["before"] + rates["after"]
    # each round's rate with the node against the mean of the windows beside it (before it joined, after it left)
    gains = [during / statistics.mean([alone[i], alone[i + 1]]) for i, during in enumerate(rates["with the node"])]

    def cell(values: List[float]) -> str:
        return f"{statistics.mean(values):.0f} [{min(values):.0f}-{max(values):.0f}]"
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return "\n".join([
        "# Elastic rollout capacity", "",
        f"{when}, {platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"`python benchmarks/elastic.py {' '.join(sys.argv[1:])}`, {wall_s:.0f} s in all.", "",
        f"A Ray cluster of `ray start` nodes on this machine, each pinned to its own core: the head (core "
        f"{cores[0]}) holds `rlp run`, its Redis, the learner, the reward worker and one rollout worker; a node "
        f"pinned to core {cores[1]} joins {args.rounds} times, and each time the job's elastic rollout worker "
        f"(`rollout.max_workers: 2`) joins there and leaves with it. Tiny Qwen2 (2 layers, hidden 64), RL only, "
        f"4 prompts x 8 completions of up to 48 tokens a step, one decoding thread a worker. Trained samples/s over "
        f"{args.window_s:g} s windows: once before the first join, then in each round with the node's worker "
        f"generating and after it left.", "",
        "| trained samples/s | mean [min-max] | windows |", "|---|---|---|",
        f"| the head alone (before the first join, and after each leave) | {cell(alone)} | "
        f"{', '.join(f'{r:.0f}' for r in alone)} |",
        f"| with the added node's worker | {cell(rates['with the node'])} | "
        f"{', '.join(f'{r:.0f}' for r in rates['with the node'])} |",
        f"| with the node / the windows beside it | {statistics.mean(gains):.2f}x "
        f"[{min(gains):.2f}-{max(gains):.2f}x] | {', '.join(f'{g:.2f}x' for g in gains)} |", "",
        "| accounting | |", "|---|---|",
        *[f"| {key} | {value} |" for key, value in counts.items()], "",
        "Capacity events: " + "; ".join(event.split(";")[0] for event in result["events"]), ""])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--window-s", type=float, default=15.0)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "elastic.md"))
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))[:2]
    if len(cores) < 2:
        sys.exit("elastic.py needs 2 cores: the head's and the added node's")
    out_dir = Path(tempfile.mkdtemp(prefix="rlp-elastic-"))
    print(f"the job's config, log and run folder: {out_dir}", flush=True)
    start = time.monotonic()
    result = measure(args.rounds, args.window_s, cores, out_dir)
    text = report(result, args, cores, out_dir / NAME, time.monotonic() - start)
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
