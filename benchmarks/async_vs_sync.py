"""Asynchronous vs synchronous RL: the same job from the same SFT checkpoint at several
`rl.max_staleness` values (0 is fully synchronous), compared on wall time to a target held-out
accuracy, samples/s, learner and rollout busy fractions and final accuracy.

Usage: python benchmarks/async_vs_sync.py [--config configs/quickstart.yaml] [--staleness 0 1 2 4]
           [--target 0.9] [--out benchmarks/results/async_vs_sync.md] [key=value ...]
Extra key=value overrides apply to every run (e.g. rl.max_steps=200 eval.every_steps=20).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
from datetime import date
from typing import Dict, List, Optional

import ray

from rlplatform.config import load_config
from rlplatform.job.controller import run_job

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def time_to_target(history: List[Dict], target: float) -> Optional[Dict]:
    """The first in-run evaluation at or above `target` (its wall_s, version, samples_seen)."""
    return next((point for point in history if point["accuracy"] >= target), None)


def sft_checkpoint(config_path: str, overrides: List[str], out_dir: str) -> Dict:
    """The shared starting point: the config's SFT stage alone; returns its summary."""
    summary = run_job(load_config(config_path, overrides + [f"output_dir={out_dir}", "name=sft", "rl.enabled=false"]))
    if summary["status"] != "completed":
        raise SystemExit(f"SFT stage failed: {summary.get('error')}")
    return summary


def rl_run(config_path: str, overrides: List[str], out_dir: str, model_path: str, staleness: int) -> Dict:
    summary = run_job(load_config(config_path, overrides + [
        f"output_dir={out_dir}", f"name=rl-staleness-{staleness}", "sft.enabled=false", "model.kind=pretrained",
        f"model.path={model_path}", f"rl.max_staleness={staleness}"]))
    if summary["status"] != "completed":
        raise SystemExit(f"RL at max_staleness={staleness} failed: {summary.get('error')}")
    return summary


def row(staleness: int, summary: Dict, target: float) -> Dict:
    rl = summary["rl"]
    reached = time_to_target(rl["eval_history"], target)
    return {"staleness": staleness, "reached": reached, "rl_wall_s": rl["wall_s"], "samples_per_s": rl["samples_per_s"],
            "learner_busy": rl["learner_busy_fraction"], "rollout_busy": rl["rollout_busy_fraction"],
            "max_gap": rl["max_staleness_trained"], "dropped": rl["samples_dropped_stale"],
            "final": summary["eval"]["after_rl"]["accuracy"]}


def report(rows: List[Dict], start_accuracy: float, target: float, command: str) -> str:
    sync = next((r for r in rows if r["staleness"] == 0), None)
    lines = [
        "# Asynchronous vs synchronous RL", "",
        f"{date.today()}, {platform.node()}: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, `{command}`", "",
        f"Every run starts from the same SFT checkpoint (held-out greedy accuracy {start_accuracy:.3f}) and "
        f"trains the same number of learner steps; time to target is the RL wall time at the first in-run "
        f"evaluation with held-out greedy accuracy >= {target} (dated when the evaluated version was "
        f"published; evaluations every `eval.every_steps`). `max_staleness: 0` is fully synchronous.", "",
        "| max_staleness | time to target (s) | steps to target | sync time / this time | samples/s "
        "| samples/s vs sync | learner busy | rollout busy | largest gap trained | dropped stale | RL wall (s) "
        "| final accuracy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        reached = r["reached"]
        speedup = (f"{sync['reached']['wall_s'] / reached['wall_s']:.2f}"
                   if reached and sync and sync["reached"] else "-")
        throughput = f"{r['samples_per_s'] / sync['samples_per_s']:.2f}" if sync else "-"
        lines.append(f"| {r['staleness']} | {reached['wall_s'] if reached else 'not reached'} | "
                     f"{reached['version'] if reached else '-'} | {speedup} | {r['samples_per_s']:.0f} | {throughput} | "
                     f"{r['learner_busy']:.2f} | {r['rollout_busy']:.2f} | {r['max_gap']} | {r['dropped']} | "
                     f"{r['rl_wall_s']:.1f} | {r['final']:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=os.path.join(REPO, "configs", "quickstart.yaml"))
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--target", type=float, default=0.9)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "async_vs_sync.md"))
    parser.add_argument("overrides", nargs="*", help="key=value applied to every run")
    args = parser.parse_args()
    overrides = ["wandb.mode=disabled", "eval.every_steps=25", *args.overrides]
    # one cluster for every run, so no start-up is timed; logical CPUs, the cores are shared
    ray.init(num_cpus=max(os.cpu_count() or 1, 8), include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as out_dir:
        start = sft_checkpoint(args.config, overrides, out_dir)
        model_path = os.path.join(out_dir, "sft", "model")
        rows = []
        for staleness in args.staleness:
            rows.append(row(staleness, rl_run(args.config, overrides, out_dir, model_path, staleness), args.target))
            print(rows[-1], flush=True)
    command = "python benchmarks/async_vs_sync.py " + " ".join(sys.argv[1:])
    text = report(rows, start["eval"]["after_sft"]["accuracy"], args.target, command.strip())
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
