"""rlplatform against TRL's GRPOTrainer on the same machine, from the same starting weights.

The base is built in the run: ../shared/bench/make_base.py writes the model shape, tokenizer and
addition rows, then rlplatform's SFT stage trains it until held-out greedy accuracy first reaches
`--base-accuracy` (checked every 25 steps); each scenario's target is its measured starting
accuracy + `--gain`. TRL runs through benchmarks/trl_runner.py (the settings of
../shared/bench/trl_peer.py, evaluating as it trains), one process per seed; rlplatform runs
`rlp run --seeds N` in its own process, synchronous (`max_staleness: 0`) and asynchronous
(`max_staleness: 1`). Each system runs `--seeds` seeds (0, 1, ...; 3 by default), and the tables give
the mean over them with the range: ratios pair each seed of rlplatform with the same seed of TRL. Scenarios:

- overhead: the instant exact-match reward; measures framework cost against one process;
- io_reward: exact match behind 30 ms of waiting per completion (async I/O, a remote judge);
- cpu_reward: exact match behind 30 ms of computation per completion (a local verifier);
- long_tail: completions of 3 to 40 tokens (benchmarks/long_tail.py).

Per system: trained completions/s, time to target, final accuracy, end-to-end wall time and
start-up (process start to first learner step); a table per scenario in results/vs_trl.md and
held-out accuracy against training time (the first seed's) in results/vs_trl.png.

Usage: python benchmarks/vs_trl.py [--quick] [--seeds 3] [--steps 320] [--scenarios overhead io_reward cpu_reward long_tail]
Needs the `bench` extra (`pip install -e ".[dev,bench]"`: trl, datasets, matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import statistics
import time
from dataclasses import dataclass, field
from datetime import date
from typing import Dict, List, Optional, Tuple

import long_tail  # benchmarks/long_tail.py, beside this script
import plots  # benchmarks/plots.py, beside this script

from rlplatform.config import RewardSpec, load_config, to_yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_BENCH = os.path.join(os.path.dirname(REPO), "shared", "bench")
PROMPTS, GROUP, LR, COMPLETION_TOKENS = 16, 8, 2e-4, 6


@dataclass
class Result:
    """One system's figures in one scenario."""
    system: str
    steps: int
    trained: int  # completions the learner trained on
    train_s: float  # training wall time (no start-up, no final evaluation)
    end_to_end_s: float  # the whole process, start-up and evaluations included
    startup_s: Optional[float]  # process start to the first learner step
    start_accuracy: float  # held-out greedy accuracy of the starting weights
    accuracy: float  # held-out greedy accuracy after `steps` steps
    history: List[Tuple[float, float]] = field(default_factory=list)  # (training seconds, accuracy)
    breakdown: Optional[Dict[str, float]] = None  # rlplatform: seconds per component

    @property
    def trained_per_s(self) -> float:
        return self.trained / self.train_s

    def time_to(self, target: float) -> Optional[float]:
        return next((seconds for seconds, accuracy in self.history if accuracy >= target), None)


@dataclass
class Scenario:
    key: str
    title: str
    note: str
    base: str
    steps: int
    completion_tokens: int = COMPLETION_TOKENS
    eval_tokens: int = 5
    reward_delay_ms: float = 0.0
    reward_cpu_ms: float = 0.0


def build_base(work: str, max_steps: int, stop_at: float) -> Tuple[str, Dict]:
    """make_base.py's model shape, tokenizer and rows, trained by rlplatform's SFT stage until held-out
    accuracy first reaches `stop_at`; returns (base directory, SFT figures)."""
    seed_dir = os.path.join(work, "untrained")
    subprocess.run([sys.executable, os.path.join(SHARED_BENCH, "make_base.py"), seed_dir, "--steps", "1"],
                   check=True, capture_output=True)
    config = load_config(None, _data_overrides(seed_dir) + [
        f"output_dir={work}", "name=base", "wandb.mode=disabled", "rl.enabled=false", f"sft.steps={max_steps}",
        "sft.lr=3e-3", "sft.batch_size=128", f"sft.stop_at_accuracy={stop_at}", "sft.eval_every=25",
        "eval.max_new_tokens=5"])
    [(summary, _)] = run_ours(config, work)
    base = os.path.join(work, "base-model")
    shutil.copytree(os.path.join(work, "base", "model"), base)
    for name in ("train.jsonl", "test.jsonl"):
        shutil.copy(os.path.join(seed_dir, name), base)
    return base, {"steps": summary["stages"]["sft"]["steps"], "accuracy": summary["eval"]["after_sft"]["accuracy"]}


def _data_overrides(base: str) -> List[str]:
    return ["model.kind=pretrained", f"model.path={base}", "data.kind=jsonl",
            f"data.train_path={os.path.join(base, 'train.jsonl')}", f"data.test_path={os.path.join(base, 'test.jsonl')}"]


def run_ours(config, work: str, seeds: Optional[int] = None) -> List[Tuple[Dict, float]]:
    """`rlp run` on `config` in a fresh process (its own Ray and Redis), with `--seeds` when `seeds` is given:
    each run's (summary, seconds). Without: the one run and the process's seconds; with: each seed's run and its
    job's wall time (the later seeds run on the Ray the first one started)."""
    path = os.path.join(work, f"{config.name}.yaml")
    with open(path, "w") as f:
        f.write(to_yaml(config))
    started = time.perf_counter()
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    several = ["--seeds", str(seeds)] if seeds is not None else []
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "rlp"), "run", *several, path], check=True,
                   cwd=REPO, env=env, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    if not several:
        with open(os.path.join(config.run_dir, "summary.json")) as f:
            return [(json.load(f), wall)]
    with open(os.path.join(config.run_dir, "seeds.json")) as f:
        runs = [row["run_dir"] for row in json.load(f)["seeds"]]
    summaries = []
    for run_dir in runs:
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
        summaries.append((summary, summary["wall_s"]))
    return summaries


def ours(scenario: Scenario, staleness: int, work: str, eval_every: int, seeds: int) -> List[Result]:
    """rlplatform at `staleness` for seeds 0 to `seeds` - 1 (`rlp run --seeds`)."""
    config = load_config(None, _data_overrides(scenario.base) + [
        f"output_dir={work}", f"name={scenario.key}-staleness-{staleness}", "wandb.mode=disabled",
        "sft.enabled=false", f"rl.max_steps={scenario.steps}", f"rl.batch_prompts={PROMPTS}",
        f"rl.group_size={GROUP}", f"rl.lr={LR}", f"rl.max_new_tokens={scenario.completion_tokens}",
        f"rl.max_staleness={staleness}", "rl.temperature=1.0", "rl.track_reference_kl=false",
        f"eval.every_steps={eval_every}", f"eval.max_new_tokens={scenario.eval_tokens}"])
    if scenario.reward_delay_ms or scenario.reward_cpu_ms:
        config.imports = ["benchmarks.bench_rewards"]
        fn, params = (("slow_exact_match", {"delay_ms": scenario.reward_delay_ms}) if scenario.reward_delay_ms
                      else ("cpu_exact_match", {"work_ms": scenario.reward_cpu_ms}))
        config.rewards = [RewardSpec(fn=f"benchmarks.bench_rewards:{fn}", params=params)]
    mode = "sync" if staleness == 0 else f"async (staleness {staleness})"
    results = []
    for summary, wall in run_ours(config, work, seeds):
        rl = summary["rl"]
        start = summary["eval"]["before_rl"]["accuracy"]  # no SFT here: the starting weights' accuracy
        results.append(Result(f"rlplatform {mode}", rl["steps"], rl["samples_trained"], rl["wall_s"], wall,
                              summary["startup_s"]["to_first_rl_step_s"], start,
                              summary["eval"]["after_rl"]["accuracy"],
                              [(0.0, start)] + [(h["wall_s"], h["accuracy"]) for h in rl["eval_history"]],
                              rl["time_breakdown"]))
    return results


def trl(scenario: Scenario, eval_every: int, seed: int) -> Result:
    """benchmarks/trl_runner.py in its own process; GRPOTrainer trains every completion it generates."""
    runner = os.path.join(REPO, "benchmarks", "trl_runner.py")
    started = time.perf_counter()
    out = subprocess.run([sys.executable, runner, scenario.base, "--steps", str(scenario.steps),
                          "--max-completion-length", str(scenario.completion_tokens),
                          "--eval-tokens", str(scenario.eval_tokens), "--eval-every", str(eval_every),
                          "--prompts", str(PROMPTS), "--group", str(GROUP), "--lr", str(LR),
                          "--reward-delay-ms", str(scenario.reward_delay_ms),
                          "--reward-cpu-ms", str(scenario.reward_cpu_ms), "--seed", str(seed),
                          "--out", tempfile.mkdtemp()],
                         check=True, capture_output=True, text=True).stdout
    wall = time.perf_counter() - started
    run = json.loads(out.strip().splitlines()[-1])
    history = [(0.0, run["acc_before"])] + [(seconds, acc) for _, seconds, acc in run["eval_history"]]
    return Result("TRL GRPOTrainer", run["steps"], run["completions"], run["wall_s"], wall, run["startup_s"],
                  run["acc_before"], run["acc_after"], history)


def _mean_range(values: List[float], fmt: str) -> str:
    """The mean of `values`, then [min-max] where there are several."""
    mean = fmt.format(statistics.fmean(values))
    return mean if len(values) == 1 else f"{mean} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def table(scenario: Scenario, systems: List[List[Result]], target: float) -> List[str]:
    """The scenario's section: each system's figures over its seeds (the first system is the peer, TRL)."""
    peer = systems[0]
    lines = [f"### {scenario.title}", "", scenario.note, "",
             f"Starting accuracy (rlplatform's evaluator, sync run) {systems[1][0].start_accuracy:.3f}; "
             f"target {target:.3f}. Each cell: the mean over {len(peer)} seed(s), then [min-max] over them; a ratio "
             f"pairs each seed with TRL's same seed.", "",
             "| system | steps | trained completions | train wall (s) | trained completions/s | vs TRL "
             "| time to target (s) | vs TRL | accuracy after | end-to-end (s) | start-up to first step (s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for runs in systems:
        reached = [r.time_to(target) for r in runs]
        hits = [t for t in reached if t is not None]
        ttt = "not reached" if not hits else _mean_range(hits, "{:.1f}") + (
            f" ({len(hits)} of {len(runs)} seeds)" if len(hits) < len(runs) else "")
        faster = [p.time_to(target) / t for p, t in zip(peer, reached) if t and p.time_to(target)]
        ttt_ratio = f"{_mean_range(faster, '{:.2f}')}x faster" if faster and runs is not peer else "-"
        ratio = _mean_range([r.trained_per_s / p.trained_per_s for r, p in zip(runs, peer)], "{:.2f}")
        startups = [r.startup_s for r in runs if r.startup_s is not None]
        lines.append(f"| {runs[0].system} | {runs[0].steps} | {runs[0].trained} | "
                     f"{_mean_range([r.train_s for r in runs], '{:.1f}')} | "
                     f"{_mean_range([r.trained_per_s for r in runs], '{:.0f}')} | {ratio}x | {ttt} | {ttt_ratio} | "
                     f"{_mean_range([r.accuracy for r in runs], '{:.3f}')} | "
                     f"{_mean_range([r.end_to_end_s for r in runs], '{:.0f}')} | "
                     f"{_mean_range(startups, '{:.1f}') if startups else '-'} |")
    lines += ["", "Where rlplatform's time went (seconds of the train wall time, the mean over the seeds; components "
              "run at once, so they overlap; reward latency is the mean from a group's completion to its score):", "",
              "| system | wall | generation | queue submit | reward work | reward latency | learner steps | "
              "weight publish | weight sync |", "|---|---|---|---|---|---|---|---|---|"]
    for runs in systems[1:]:
        b = {key: statistics.fmean(r.breakdown[key] for r in runs) for key in runs[0].breakdown}
        lines.append(f"| {runs[0].system} | {statistics.fmean(r.train_s for r in runs):.1f} | "
                     f"{b['generation_s']:.1f} | {b['queue_submit_s']:.2f} | "
                     f"{b['reward_busy_s']:.1f} | {b['reward_latency_s_mean'] * 1000:.0f} ms | "
                     f"{b['learner_step_s']:.1f} | {b['weight_publish_s']:.2f} | {b['weight_sync_s']:.2f} |")
    return lines + [""]


def scenarios(args, base: str, work: str) -> List[Scenario]:
    reward_workers = load_config(None, []).reward_workers
    found = []
    if "overhead" in args.scenarios:
        found.append(Scenario("overhead", "1. Overhead-bound: instant exact-match reward",
                              "Framework cost against one process: the reward takes no time.", base, args.steps))
    if "io_reward" in args.scenarios:
        delay = args.reward_ms
        found.append(Scenario("io_reward", f"2. I/O-bound reward: {delay:g} ms of waiting per completion",
                              f"An async reward that waits {delay:g} ms per completion, as a remote judge does "
                              f"(`bench_rewards.slow_exact_match`): rlplatform's reward worker awaits "
                              f"{reward_workers.concurrency} at a time while generation and learning go on; "
                              f"TRL calls it in its training loop, one `time.sleep` per batch of completions in "
                              f"sequence (`trl_runner.py --reward-delay-ms`, as `trl_peer.py`).",
                              base, args.reward_steps, reward_delay_ms=delay))
    if "cpu_reward" in args.scenarios:
        work_ms = args.reward_ms
        found.append(Scenario("cpu_reward", f"2b. CPU-bound reward: {work_ms:g} ms of computation per completion",
                              f"A reward that hashes for {work_ms:g} ms of CPU time per completion "
                              f"(`bench_rewards.cpu_exact_match`), as a local verifier does: no waiting to overlap, "
                              f"so rlplatform gains only by scoring beside generation and learning "
                              f"({reward_workers.num_workers} reward worker process, {reward_workers.concurrency} "
                              f"threads; hashlib releases the GIL) and TRL scores in its loop.",
                              base, args.reward_steps, reward_cpu_ms=work_ms))
    if "long_tail" in args.scenarios:
        tail_base = os.path.join(work, "long_tail")
        tail = long_tail.build(base, tail_base, args.long_tail_base_steps)
        tokens = tail["max_completion_tokens"]
        found.append(Scenario("long_tail", f"3. Long tail: one prompt in {tail['long_every']} asks for a worked answer",
                              f"`benchmarks/long_tail.py` fine-tunes the base for {tail['fine_tune_steps']} steps "
                              f"on addition mixed with worked products (`37*4=` -> `37+37+37+37=148`): completions "
                              f"run 3 to {tokens} tokens, and both systems use that limit.",
                              tail_base, args.long_tail_steps, completion_tokens=tokens, eval_tokens=tokens))
    return found


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a smoke run: a few steps of every scenario")
    parser.add_argument("--base-accuracy", type=float, default=0.3, help="the base's SFT stops once it reaches this")
    parser.add_argument("--base-max-steps", type=int, default=1500)
    parser.add_argument("--gain", type=float, default=0.15, help="target = starting accuracy + gain")
    parser.add_argument("--steps", type=int, default=320)
    parser.add_argument("--scenarios", nargs="+", default=["overhead", "io_reward", "cpu_reward", "long_tail"])
    parser.add_argument("--reward-ms", type=float, default=30.0)
    parser.add_argument("--reward-steps", type=int, default=40)
    parser.add_argument("--long-tail-steps", type=int, default=40)
    parser.add_argument("--long-tail-base-steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--seeds", type=int, help="seeds per system (0, 1, ...): ranges, not one draw; default 3 "
                                                   "(1 with --quick)")
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "vs_trl.md"))
    args = parser.parse_args()
    if args.seeds is None:
        args.seeds = 1 if args.quick else 3
    if args.quick:
        args.base_max_steps, args.steps, args.reward_steps, args.long_tail_steps = 50, 4, 2, 2
        args.long_tail_base_steps, args.eval_every = 5, 2
    return args


def seeds_used(count: int) -> str:
    return "seed 0" if count == 1 else f"{count} seeds (0 to {count - 1})"


def main() -> None:
    args = parse_args()
    work = tempfile.mkdtemp()
    sys.path.insert(0, REPO)
    base, sft = build_base(work, args.base_max_steps, args.base_accuracy)
    sections, panels = [], {}
    for scenario in scenarios(args, base, work):
        systems = [[trl(scenario, args.eval_every, seed) for seed in range(args.seeds)],
                   ours(scenario, 0, work, args.eval_every, args.seeds),
                   ours(scenario, 1, work, args.eval_every, args.seeds)]
        target = systems[1][0].start_accuracy + args.gain
        section = table(scenario, systems, target)
        sections += section
        panels[scenario.title] = ({runs[0].system: runs[0].history for runs in systems}, target)
        print("\n".join(section), flush=True)
    image = os.path.splitext(args.out)[0] + ".png"
    plots.accuracy_panels(panels, image, "training seconds")
    report = "\n".join([
        "# rlplatform vs TRL", "",
        f"{date.today()}, {platform.node()}: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
        f"`{' '.join(['python benchmarks/vs_trl.py', *sys.argv[1:]])}`", "",
        f"Base: make_base.py's model and rows, SFT by rlplatform until held-out greedy accuracy first reached "
        f"{args.base_accuracy} (checked every 25 steps): {sft['accuracy']:.3f} after {sft['steps']} steps. Target: "
        f"starting accuracy + {args.gain}. Seeds: {seeds_used(args.seeds)} per system, rlplatform's by `rlp run "
        f"--seeds`; its end-to-end time is each seed's job (`wall_s`: Redis, Ray, the job), not the `rlp` process's "
        f"own start, and its later seeds run on the Ray its first one started. Both systems: {PROMPTS} prompts x {GROUP} completions per step, lr {LR} "
        f"decaying linearly to 0, temperature 1, no KL term, held-out evaluation every {args.eval_every} steps "
        f"(TRL's clock stops while it evaluates; rlplatform evaluates on a spare worker at idle CPU priority, "
        f"`eval.priority`, and dates each result when the evaluated version was published). Trained completions/s: "
        f"TRL trains every completion it generates; rlplatform's figure counts only samples the learner trained on. "
        f"Train wall: TRL's `trainer.train()` with its model loaded; rlplatform's RL stage from the moment its "
        f"rollout and reward workers are constructed (model loaded) to its last step, its first batch's generation "
        f"included. End-to-end is the whole process, start-up and evaluations included.", "",
        f"![held-out accuracy against training time]({os.path.basename(image)})", "", *sections])
    print(report)
    with open(args.out, "w") as f:
        f.write(report)


if __name__ == "__main__":
    main()
