"""`rlp run --seeds N`: one job run once per seed, and its figures across the seeds.

`run_seeds` runs the job as `rlp run` does (`cli._run_once`) for seeds `seed`, `seed+1`, ...,
`seed+N-1`, one after another, each an ordinary run in `<output_dir>/<name>/<name>-seed-<s>/`
(its own name, so its Redis keys, Ray actors and W&B run are its own) in one W&B group (`wandb.group`,
unset: `<name>`).
It stops at the first seed that does not complete. It then reads each seed's summary.json
(`seed_figures`), takes the mean, min, max and spread of every figure over the completed seeds
(`statistics`), and writes them to `<output_dir>/<name>/seeds.json` and the console (`format_table`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Callable, Dict, List, Mapping, Optional, Tuple

from rlplatform.config import JobConfig
from rlplatform.job.summaries import EVAL_LABELS

SEEDS_JSON = "seeds.json"
SUMMARY_JSON = "summary.json"  # what each seed's job writes in its run directory
# a policy's figure -> (column heading, format); `wall_s` is the job's
FIGURES = {"accuracy_after_sft": ("after SFT", "{:.3f}"), "accuracy_before_rl": ("before RL", "{:.3f}"),
           "accuracy_after_rl": ("after RL", "{:.3f}"),
           "gain": ("gain", "{:.3f}"), "trained_per_s": ("trained/s", "{:.1f}")}
WALL = ("wall s", "{:.0f}")
STATISTICS = ("mean", "min", "max", "spread")


def seed_overrides(config: JobConfig, seed: int) -> List[str]:
    """The overrides that make `config` seed `seed`'s run: under `<run_dir>/`, named `seed_name`."""
    return [f"seed={seed}", f"output_dir={config.run_dir}", f"name={seed_name(config, seed)}",
            f"wandb.group={config.wandb.group or config.name}"]


def seed_name(config: JobConfig, seed: int) -> str:
    return f"{config.name}-seed-{seed}"


def run_seeds(config: JobConfig, count: int, run: Callable[[List[str], Optional[float]], int]) -> int:
    """Run `config` for `count` seeds from `config.seed` with `run(overrides, started_at)`, which runs one job
    as `rlp run` does and returns its exit code (`started_at` None: the process's start). Stops at the first
    seed that does not exit 0 (or raises), and returns that exit code; writes seeds.json and prints the table
    of the seeds that wrote a summary in any case."""
    rows: List[Dict] = []
    try:
        for index, seed in enumerate(range(config.seed, config.seed + count)):
            run_dir = os.path.join(config.run_dir, seed_name(config, seed))
            print(f"rlp: seed {seed} ({index + 1} of {count}) in {run_dir}", file=sys.stderr)
            earlier = _file_state(os.path.join(run_dir, SUMMARY_JSON))
            try:
                code = run(seed_overrides(config, seed), time.time() if index else None)
            finally:
                summary = _summary_written(run_dir, earlier)
                if summary is not None:
                    rows.append({"seed": seed, "run_dir": os.path.abspath(run_dir), "status": summary["status"],
                                 "figures": seed_figures(summary)})
            if code != 0:
                return code
        return 0
    finally:
        if rows:
            path = os.path.join(config.run_dir, SEEDS_JSON)
            result = {"name": config.name, "seeds": rows, "statistics": statistics(rows)}
            with open(path, "w") as f:
                json.dump(result, f, indent=2)
            print(format_table(result))
            completed = sum(row["status"] == "completed" for row in rows)
            print(f"{config.name}: {completed} of {count} seeds completed, figures in {path}")


def _file_state(path: str) -> Optional[Tuple[int, int, int]]:
    """(inode, mtime in ns, size) of the file at `path`, None where there is none."""
    try:
        found = os.stat(path)
    except FileNotFoundError:
        return None
    return found.st_ino, found.st_mtime_ns, found.st_size


def _summary_written(run_dir: str, earlier: Optional[Tuple[int, int, int]]) -> Optional[Dict]:
    """The summary.json the seed's run wrote in `run_dir`, None where it wrote none: where the file is as it
    was before (`earlier`, `_file_state`), it is an earlier run's."""
    path = os.path.join(run_dir, SUMMARY_JSON)
    if _file_state(path) in (None, earlier):
        return None
    with open(path) as f:
        return json.load(f)


def seed_figures(summary: Mapping) -> Dict[str, float]:
    """A run's figures from its summary.json, those it holds: held-out accuracy after SFT (or before RL, without
    SFT) and after RL, the gain, trained samples/s (`<policy>/<figure>` for each of several policies) and the job's wall time."""
    policies = summary.get("policies") or {None: summary}
    figures: Dict[str, float] = {}
    for policy, result in policies.items():
        prefix = f"{policy}/" if policy else ""
        evals = result.get("eval", {})
        accuracy = {label: evals[label]["accuracy"] for label in EVAL_LABELS if label in evals}
        for label, value in accuracy.items():
            figures[f"{prefix}accuracy_{label}"] = value
        if len(accuracy) == 2 and "after_rl" in accuracy:
            start = accuracy.get("after_sft", accuracy.get("before_rl"))
            figures[f"{prefix}gain"] = round(accuracy["after_rl"] - start, 6)
        if "trained_per_s" in result.get("rl", {}):
            figures[f"{prefix}trained_per_s"] = result["rl"]["trained_per_s"]
    if summary.get("wall_s") is not None:
        figures["wall_s"] = summary["wall_s"]
    return figures


def statistics(rows: List[Mapping]) -> Dict[str, Dict[str, float]]:
    """Per figure, over the completed seeds' rows that hold it: n, mean, min, max and spread (max - min), to 6
    decimals."""
    values: Dict[str, List[float]] = {}
    for row in rows:
        if row["status"] == "completed":
            for figure, value in row["figures"].items():
                values.setdefault(figure, []).append(value)
    return {figure: {"n": len(found), "mean": round(sum(found) / len(found), 6), "min": min(found),
                     "max": max(found), "spread": round(max(found) - min(found), 6)}
            for figure, found in values.items()}


def format_table(result: Mapping) -> str:
    """seeds.json as a console table: a row per seed, then the mean, min, max and spread of each figure."""
    figures = list(dict.fromkeys(f for row in result["seeds"] for f in row["figures"]))
    formats = [_format(figure) for figure in figures]
    lines = [["seed", "status", *(heading for heading, _ in formats)]]
    for row in result["seeds"]:
        lines.append([str(row["seed"]), row["status"], *(
            fmt.format(row["figures"][f]) if f in row["figures"] else "-" for f, (_, fmt) in zip(figures, formats))])
    for name in STATISTICS:
        lines.append([name, "", *(fmt.format(result["statistics"][f][name]) if f in result["statistics"] else "-"
                                  for f, (_, fmt) in zip(figures, formats))])
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in
                               enumerate(zip(line, widths))).rstrip() for line in lines)


def _format(figure: str) -> Tuple[str, str]:
    """(column heading, format) of a figure, `<policy>/` shown before the heading."""
    if figure == "wall_s":
        return WALL
    policy, _, name = figure.rpartition("/")
    heading, fmt = FIGURES[name]
    return (f"{policy} {heading}" if policy else heading), fmt
