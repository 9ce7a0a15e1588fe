"""Asynchronous vs synchronous RL: the same job from the same SFT checkpoint at several
`rl.max_staleness` values (0 is fully synchronous), each with several seeds, compared on wall
time to a target held-out accuracy (the SFT checkpoint's, measured in the same run, plus `--gain`),
samples/s, learner and rollout busy fractions and final accuracy (mean and min-max over seeds);
held-out accuracy against time in a PNG beside the table.

Usage: python benchmarks/async_vs_sync.py [--quick] [--config configs/quickstart.yaml] [--staleness 0 1 2 4]
           [--seeds 0 1 2] [--gain 0.1] [--out benchmarks/results/async_vs_sync.md] [key=value ...]
Extra key=value overrides apply to every run (e.g. rl.max_steps=200 eval.every_steps=20).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from datetime import date
from typing import Dict, List, Optional

import plots  # benchmarks/plots.py, beside this script
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


def rl_run(config_path: str, overrides: List[str], out_dir: str, model_path: str, staleness: int,
           seed: int) -> Dict:
    summary = run_job(load_config(config_path, overrides + [
        f"output_dir={out_dir}", f"name=rl-staleness-{staleness}-seed-{seed}", "sft.enabled=false",
        "model.kind=pretrained", f"model.path={model_path}", f"rl.max_staleness={staleness}", f"seed={seed}"]))
    if summary["status"] != "completed":
        raise SystemExit(f"RL at max_staleness={staleness}, seed {seed} failed: {summary.get('error')}")
    return summary


def run_figures(summary: Dict, target: float) -> Dict:
    """One run's figures: time and steps to target (None: not reached), throughput, busy fractions."""
    rl = summary["rl"]
    reached = time_to_target(rl["eval_history"], target)
    start = summary["eval"]["before_rl"]["accuracy"]
    return {"reached_s": reached["wall_s"] if reached else None, "reached_step": reached["version"] if reached else None,
            "rl_wall_s": rl["wall_s"], "samples_per_s": rl["samples_per_s"], "trained_per_s": rl["trained_per_s"],
            "learner_busy": rl["learner_busy_fraction"], "rollout_busy": rl["rollout_busy_fraction"],
            "max_gap": rl["max_staleness_trained"], "dropped": rl["samples_dropped_stale"],
            "final": summary["eval"]["after_rl"]["accuracy"],
            "curve": [(0.0, start)] + [(h["wall_s"], h["accuracy"]) for h in rl["eval_history"]]}


def spread(values: List[float], digits: int = 1) -> str:
    """mean (min-max) of `values`, or '-' when there are none."""
    if not values:
        return "-"
    mean = statistics.mean(values)
    return f"{mean:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def report(runs: Dict[int, List[Dict]], start_accuracy: float, target: float, seeds: List[int], command: str,
           image: str) -> str:
    sync = runs.get(0)
    lines = [
        "# Asynchronous vs synchronous RL", "",
        f"{date.today()}, {platform.node()}: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, `{command}`", "",
        f"Every run starts from the same SFT checkpoint (held-out greedy accuracy {start_accuracy:.3f}) and "
        f"trains the same number of learner steps, with seeds {', '.join(map(str, seeds))} per setting; figures "
        f"are the mean over seeds with (min-max). Time to target is the RL wall time at the first in-run "
        f"evaluation with held-out greedy accuracy >= {target:.3f} (dated when the evaluated version was "
        f"published; evaluations every `eval.every_steps`); its mean is over the seeds that reached it. "
        f"`max_staleness: 0` is fully synchronous.", "",
        f"![held-out accuracy against RL wall time, per staleness setting]({os.path.basename(image)})", "",
        "| max_staleness | reached target | time to target (s) | steps to target | sync time / this time "
        "| samples/s | trained/s | learner busy | rollout busy | largest gap trained | dropped stale | RL wall (s) "
        "| final accuracy |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for staleness, figures in runs.items():
        times = [f["reached_s"] for f in figures if f["reached_s"] is not None]
        sync_times = [f["reached_s"] for f in sync if f["reached_s"] is not None] if sync else []
        speedup = f"{statistics.mean(sync_times) / statistics.mean(times):.2f}" if times and sync_times else "-"
        values = {k: [f[k] for f in figures] for k in figures[0] if k != "curve"}
        lines.append(f"| {staleness} | {len(times)}/{len(figures)} | {spread(times)} | "
                     f"{spread([f['reached_step'] for f in figures if f['reached_step'] is not None], 0)} | "
                     f"{speedup} | {spread(values['samples_per_s'], 0)} | {spread(values['trained_per_s'], 0)} | "
                     f"{spread(values['learner_busy'], 2)} | {spread(values['rollout_busy'], 2)} | "
                     f"{max(values['max_gap'])} | {spread(values['dropped'], 0)} | {spread(values['rl_wall_s'])} | "
                     f"{spread(values['final'], 3)} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=os.path.join(REPO, "configs", "quickstart.yaml"))
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--gain", type=float, default=0.1, help="target = the SFT checkpoint's accuracy + gain")
    parser.add_argument("--quick", action="store_true", help="a smoke run: staleness 0 and 1, a few steps")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "async_vs_sync.md"))
    parser.add_argument("overrides", nargs="*", help="key=value applied to every run")
    args = parser.parse_args()
    overrides = ["wandb.mode=disabled", "eval.every_steps=25", *args.overrides]
    if args.quick:
        args.staleness = [0, 1]
        overrides += ["sft.steps=20", "rl.max_steps=4", "eval.every_steps=2"]
    # one cluster for every run, so no start-up is timed; logical CPUs, the cores are shared
    ray.init(num_cpus=max(os.cpu_count() or 1, 8), include_dashboard=False, log_to_driver=False)
    runs: Dict[int, List[Dict]] = {}
    with tempfile.TemporaryDirectory() as out_dir:
        start = sft_checkpoint(args.config, overrides, out_dir)
        target = start["eval"]["after_sft"]["accuracy"] + args.gain
        model_path = os.path.join(out_dir, "sft", "model")
        for staleness in args.staleness:
            for seed in args.seeds:
                summary = rl_run(args.config, overrides, out_dir, model_path, staleness, seed)
                runs.setdefault(staleness, []).append(run_figures(summary, target))
                print(staleness, seed, {k: v for k, v in runs[staleness][-1].items() if k != "curve"}, flush=True)
    image = os.path.splitext(args.out)[0] + ".png"
    plots.accuracy_panels({f"max_staleness {s}": ({f"seed {seed}": f["curve"] for seed, f in zip(args.seeds, figures)},
                                                  target) for s, figures in runs.items()},
                          image, "RL wall seconds")
    command = "python benchmarks/async_vs_sync.py " + " ".join(sys.argv[1:])
    text = report(runs, start["eval"]["after_sft"]["accuracy"], target, args.seeds, command.strip(), image)
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
