"""The controller's load: CPU seconds of the `rlp run` process during the RL stage per 10,000
trained samples, with 1, 2 and 4 rollout workers. The controller only chooses batches from
small per-sample records (ids, version, reward, token counts); learner ranks read the samples
themselves from Redis, so its cost per trained sample should not grow with the rollout fleet.

Each run is the quickstart's RL stage from a freshly initialised policy (no SFT: completions run
to `rl.max_new_tokens` unless an EOS is sampled), every sample trained (no zero-advantage filter).

A second table times the read path alone: results of 64 and 1024 completion tokens read from
the results stream and serialised as the controller holds them.

Usage: python benchmarks/controller_load.py [--workers 1 2 4] [--read-tokens 64 1024]
           [--out benchmarks/results/controller_load.md] [key=value ...]
"""

from __future__ import annotations

import argparse
import os
import pickle
import platform
import sys
import tempfile
import time
from datetime import datetime, timezone
from typing import Dict, List

from rlplatform.config import load_config
from rlplatform.job.controller import run_job

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = ["sft.enabled=false", "rl.max_steps=12", "rl.max_new_tokens=48", "rl.max_staleness=2",
            "rl.log_every=100", "eval.every_steps=0", "data.test_size=16", "wandb.mode=disabled",
            "rollout.num_cpus=0.25", "learner.num_cpus=0.5", "reward_workers.num_cpus=0.25"]


def measure(workers: int, overrides: List[str], out_dir: str) -> Dict:
    """One RL stage with `workers` rollout workers: the controller's CPU seconds and what it trained."""
    config = load_config(os.path.join(REPO, "configs/quickstart.yaml"), SETTINGS + overrides + [
        f"output_dir={out_dir}", f"name=controller-load-{workers}", f"rollout.num_workers={workers}"])
    summary = run_job(config)
    if summary["status"] != "completed":
        raise SystemExit(f"the run with {workers} rollout workers failed: {summary.get('error')}")
    rl = summary["rl"]
    return {"workers": workers, "trained": rl["samples_trained"], "cpu_s": rl["controller_cpu_s"],
            "wall_s": rl["wall_s"], "trained_per_s": rl["trained_per_s"],
            "cpu_per_10k": rl["controller_cpu_s"] / max(rl["samples_trained"], 1) * 10_000}


def read_path(completion_tokens: int, samples: int = 2000) -> float:
    """The controller's CPU seconds per 10k samples to read scored results from the results stream and
    serialise what it holds of them (as a learner call's arguments would be), for completions of
    `completion_tokens` tokens stored by the reward queue on an embedded Redis."""
    from rlplatform.transport.redis_server import EmbeddedRedis, connect
    from rlplatform.transport.reward_queue import RewardQueue
    from rlplatform.transport.run_keys import start_run
    from rlplatform.transport.samples import Sample, ScoredSample

    with EmbeddedRedis() as server:
        queue = RewardQueue(connect(server.url), "read-path", max_pending=samples)
        start_run(queue.client, queue.keys.run, queue.bound())
        queue.create_group()
        queue.submit([Sample(f"{i // 8}/{i % 8}", str(i // 8), "policy", "1+1=", "2", prompt_ids=list(range(32)),
                             completion_ids=list(range(completion_tokens)),
                             behaviour_logprobs=[-1.0] * completion_tokens, token_versions=[0] * completion_tokens)
                      for i in range(samples)])
        for start in range(0, samples, 500):
            held = queue.fetch("reward-0", 500, 100)
            queue.store_results([(msg_id, ScoredSample(queue.decode(raw), 1.0, {"exact_match": 1.0}))
                                 for msg_id, raw in held])
        cpu = time.process_time()
        while True:
            results = queue.read_results(block_ms=None)
            if not results:
                break
            pickle.dumps(results)
        return (time.process_time() - cpu) / samples * 10_000


def report(rows: List[Dict], read_rows: List, command: str) -> str:
    lines = ["# Controller load", "",
             f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}: {os.cpu_count()} CPUs, "
             f"Python {sys.version.split()[0]}, `{command}`", "",
             "| rollout workers | samples trained | controller CPU s | CPU s per 10k trained | CPU s per wall s "
             "| RL wall s | trained/s |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workers']} | {r['trained']} | {r['cpu_s']:.2f} | {r['cpu_per_10k']:.1f} | "
                     f"{r['cpu_s'] / r['wall_s']:.3f} | {r['wall_s']:.1f} | {r['trained_per_s']:.1f} |")
    lines += ["", "Reading results alone (controller CPU s per 10k samples: results stream read, decoded and "
              "serialised as held), 32-token prompts:", "", "| completion tokens | CPU s per 10k |", "|---|---|"]
    lines += [f"| {tokens} | {seconds:.2f} |" for tokens, seconds in read_rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--read-tokens", type=int, nargs="*", default=[64, 1024])
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks/results/controller_load.md"))
    parser.add_argument("overrides", nargs="*", help="key=value overrides for every run")
    args = parser.parse_args()
    command = "python benchmarks/controller_load.py " + " ".join(sys.argv[1:])
    read_rows = [(tokens, read_path(tokens)) for tokens in args.read_tokens]
    with tempfile.TemporaryDirectory() as out_dir:
        rows = [measure(workers, args.overrides, out_dir) for workers in args.workers]
    table = report(rows, read_rows, command.strip())
    print(table)
    with open(args.out, "w") as f:
        f.write(table)


if __name__ == "__main__":
    main()
