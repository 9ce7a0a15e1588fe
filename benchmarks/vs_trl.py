"""rlplatform against TRL's GRPOTrainer on the same machine, from the same starting weights.

The shared base (../shared/bench/make_base.py: a tiny Qwen2 trained on addition) is built once;
the peer is ../shared/bench/trl_peer.py, run as it is. rlplatform trains the same base on the
same rows with the same group size, prompts per step, learning rate and completion length, in
synchronous (`max_staleness: 0`) and asynchronous (`max_staleness: 1`) mode. Scenarios:

- overhead: the instant exact-match reward; measures framework cost against one process;
- slow_rewards: the same reward behind a fixed per-sample latency (a remote judge);
- long_tail: completions of 3 to 40 tokens (benchmarks/long_tail.py); TRL runs with that limit
  through benchmarks/trl_runner.py, the peer's settings otherwise.

Per system: completions/s, wall time to a target held-out greedy accuracy, accuracy after the
same number of completions, and the ratios rlplatform/TRL; written to results/vs_trl.md.

Usage: python benchmarks/vs_trl.py [--base DIR | --base-steps 800] [--steps 320] [--target 0.34]
           [--scenarios overhead slow_rewards long_tail] [--reward-delay-ms 30] [--slow-steps 20]
           [--long-tail-steps 40] [--long-tail-target 0.55]
Needs the `bench` extra (`pip install -e ".[dev,bench]"`: trl, datasets).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import date
from typing import Dict, List, Optional

import long_tail  # benchmarks/long_tail.py, beside this script
import ray

from rlplatform.config import RewardSpec, load_config
from rlplatform.job.controller import run_job

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_BENCH = os.path.join(os.path.dirname(REPO), "shared", "bench")
PROMPTS, GROUP, LR, COMPLETION_TOKENS = 16, 8, 2e-4, 6
EVAL_EVERY = 10


@dataclass
class Result:
    """One system's figures in one scenario."""
    system: str
    steps: int
    wall_s: float  # training wall time (no start-up, no final evaluation)
    completions_per_s: float
    accuracy: float  # held-out greedy accuracy after `steps` steps
    time_to_target_s: Optional[float]  # None: target not reached within the steps run
    breakdown: Optional[Dict[str, float]] = None  # rlplatform: seconds per component (summary time_breakdown)

    @property
    def completions(self) -> int:
        return self.steps * PROMPTS * GROUP


def make_base(out: str, steps: int) -> Dict:
    subprocess.run([sys.executable, os.path.join(SHARED_BENCH, "make_base.py"), out, "--steps", str(steps)],
                   check=True)
    with open(os.path.join(out, "base_info.json")) as f:
        return json.load(f)


def trl_peer(base: str, steps: int, delay_ms: float) -> Dict:
    """One run of the shared TRL peer script; its JSON line."""
    out = subprocess.run([sys.executable, os.path.join(SHARED_BENCH, "trl_peer.py"), base, "--steps", str(steps),
                          "--prompts", str(PROMPTS), "--group", str(GROUP), "--lr", str(LR),
                          "--reward-delay-ms", str(delay_ms), "--out", tempfile.mkdtemp()],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def trl_evaluated(base: str, steps: int, completion_tokens: int, eval_tokens: int) -> Dict:
    """One run of the peer's settings with held-out evaluation every EVAL_EVERY steps and a completion
    limit of choice (benchmarks/trl_runner.py); its JSON line."""
    runner = os.path.join(REPO, "benchmarks", "trl_runner.py")
    out = subprocess.run([sys.executable, runner, base, "--steps", str(steps),
                          "--max-completion-length", str(completion_tokens), "--eval-tokens", str(eval_tokens),
                          "--eval-every", str(EVAL_EVERY), "--prompts", str(PROMPTS), "--group", str(GROUP),
                          "--lr", str(LR), "--out", tempfile.mkdtemp()],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def trl_result(run: Dict, target: float, evaluated: Optional[Dict] = None) -> Result:
    """The peer's figures from `run`; time to target from the evaluation history of `evaluated` (a run
    with the same settings that evaluates as it trains), or of `run` itself when it has one."""
    history = (evaluated or run).get("eval_history", [])
    reached = next((seconds for _, seconds, acc in history if acc >= target), None)
    return Result("TRL GRPOTrainer", run["steps"], run["wall_s"], run["completions_per_s"], run["acc_after"], reached)


def ours(base: str, steps: int, staleness: int, target: float, out: str, delay_ms: float = 0.0,
         completion_tokens: int = COMPLETION_TOKENS, eval_tokens: int = 5) -> Result:
    config = load_config(None, [
        f"output_dir={out}", f"name=ours-{staleness}-{int(delay_ms)}-{time.time_ns()}", "wandb.mode=disabled",
        "model.kind=pretrained", f"model.path={base}", "data.kind=jsonl",
        f"data.train_path={os.path.join(base, 'train.jsonl')}", f"data.test_path={os.path.join(base, 'test.jsonl')}",
        "sft.enabled=false", f"rl.max_steps={steps}", f"rl.batch_prompts={PROMPTS}", f"rl.group_size={GROUP}",
        f"rl.lr={LR}", f"rl.max_new_tokens={completion_tokens}", f"rl.max_staleness={staleness}",
        "rl.temperature=1.0", "rl.track_reference_kl=false", f"eval.every_steps={EVAL_EVERY}",
        f"eval.max_new_tokens={eval_tokens}"])
    if delay_ms:
        config.imports = ["benchmarks.bench_rewards"]
        config.rewards = [RewardSpec(fn="benchmarks.bench_rewards:slow_exact_match", params={"delay_ms": delay_ms})]
    summary = run_job(config)
    if summary["status"] != "completed":
        raise SystemExit(f"rlplatform run failed: {summary.get('error')}")
    rl = summary["rl"]
    reached = next((h["wall_s"] for h in rl["eval_history"] if h["accuracy"] >= target), None)
    mode = "sync" if staleness == 0 else f"async (staleness {staleness})"
    return Result(f"rlplatform {mode}", steps, rl["wall_s"], rl["samples_per_s"],
                  summary["eval"]["after_rl"]["accuracy"], reached, rl["time_breakdown"])


def table(title: str, results: List[Result], note: str) -> List[str]:
    peer = results[0]
    lines = [f"### {title}", "", note, "",
             "| system | steps | completions | train wall (s) | completions/s | vs TRL | time to target (s) | vs TRL "
             "| accuracy after | ", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        speed = r.completions_per_s / peer.completions_per_s
        ttt = f"{r.time_to_target_s:.1f}" if r.time_to_target_s is not None else "not reached"
        ttt_ratio = (f"{peer.time_to_target_s / r.time_to_target_s:.2f}x faster"
                     if r.time_to_target_s and peer.time_to_target_s and r is not peer else "-")
        lines.append(f"| {r.system} | {r.steps} | {r.completions} | {r.wall_s:.1f} | {r.completions_per_s:.0f} | "
                     f"{speed:.2f}x | {ttt} | {ttt_ratio} | {r.accuracy:.3f} |")
    lines += ["", "Where rlplatform's time went (seconds of the train wall time; components run at once, so they "
              "overlap; reward latency is the mean from a group's completion to its score):", "",
              "| system | wall | generation | queue submit | reward work | reward latency | learner steps | "
              "weight publish | weight sync |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results[1:]:
        b = r.breakdown
        lines.append(f"| {r.system} | {r.wall_s:.1f} | {b['generation_s']:.1f} | {b['queue_submit_s']:.2f} | "
                     f"{b['reward_busy_s']:.1f} | {b['reward_latency_s_mean'] * 1000:.0f} ms | "
                     f"{b['learner_step_s']:.1f} | "
                     f"{b['weight_publish_s']:.2f} | {b['weight_sync_s']:.2f} |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", help="an existing make_base.py output; default: build one")
    parser.add_argument("--base-steps", type=int, default=800, help="make_base.py SFT steps (~0.3 accuracy here)")
    parser.add_argument("--steps", type=int, default=320)
    parser.add_argument("--target", type=float, default=0.34, help="scenarios 1 and 2 (the base is at ~0.2)")
    parser.add_argument("--scenarios", nargs="+", default=["overhead", "slow_rewards", "long_tail"])
    parser.add_argument("--reward-delay-ms", type=float, default=30.0)
    parser.add_argument("--slow-steps", type=int, default=20)
    parser.add_argument("--long-tail-steps", type=int, default=40)
    parser.add_argument("--long-tail-base-steps", type=int, default=300)
    parser.add_argument("--long-tail-target", type=float, default=0.55)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "vs_trl.md"))
    args = parser.parse_args()
    work = tempfile.mkdtemp()
    base = args.base or os.path.join(work, "base")
    info = make_base(base, args.base_steps) if not args.base else json.load(open(os.path.join(base, "base_info.json")))
    sys.path.insert(0, REPO)  # benchmarks.bench_rewards, for the reward workers too
    os.chdir(REPO)
    ray.init(num_cpus=max(os.cpu_count() or 1, 8), include_dashboard=False, log_to_driver=False)
    sections = []
    if "overhead" in args.scenarios:
        steps = args.steps
        results = [trl_result(trl_peer(base, steps, 0.0), args.target,
                              trl_evaluated(base, steps, COMPLETION_TOKENS, eval_tokens=5)),
                   ours(base, steps, 0, args.target, work), ours(base, steps, 1, args.target, work)]
        sections += table("1. Overhead-bound: instant exact-match reward", results,
                          f"TRL's completions/s and accuracy are the shared peer's; its time to target (first "
                          f"held-out accuracy at or above {args.target}) comes from a second run with the same "
                          f"settings that evaluates every {EVAL_EVERY} steps, the clock stopped while it evaluates "
                          f"(`benchmarks/trl_runner.py`). rlplatform evaluates every {EVAL_EVERY} steps on a spare "
                          f"worker while it trains (dated when the evaluated version was published).")
    if "slow_rewards" in args.scenarios:
        delay = args.reward_delay_ms
        results = [trl_result(trl_peer(base, args.slow_steps, delay), args.target),
                   ours(base, args.slow_steps, 0, args.target, work, delay_ms=delay),
                   ours(base, args.slow_steps, 1, args.target, work, delay_ms=delay)]
        sections += table(f"2. Slow rewards: {delay:g} ms per completion", results,
                          f"The same exact match behind {delay:g} ms per completion: TRL calls it in its training "
                          f"loop; rlplatform's reward workers await it concurrently (`benchmarks/bench_rewards.py`). "
                          f"The rewards, hence the learning per sample, are those of scenario 1: compare accuracy "
                          f"per sample there (over {args.slow_steps} steps the accuracies are within run-to-run "
                          f"noise of the base's).")
    if "long_tail" in args.scenarios:
        tail_base = os.path.join(work, "long_tail")
        tail = long_tail.build(base, tail_base, args.long_tail_base_steps)
        tokens, steps = tail["max_completion_tokens"], args.long_tail_steps
        results = [trl_result(trl_evaluated(tail_base, steps, tokens, tokens), args.long_tail_target),
                   ours(tail_base, steps, 0, args.long_tail_target, work, completion_tokens=tokens, eval_tokens=tokens),
                   ours(tail_base, steps, 1, args.long_tail_target, work, completion_tokens=tokens, eval_tokens=tokens)]
        sections += table(f"3. Long tail: one prompt in {tail['long_every']} asks for a worked answer", results,
                          f"`benchmarks/long_tail.py` fine-tunes the shared base for {tail['fine_tune_steps']} steps "
                          f"on addition mixed with worked products (`37*4=` -> `37+37+37+37=148`): completions run "
                          f"3 to {tokens} tokens. TRL runs the peer's settings with that completion limit, "
                          f"evaluating every {EVAL_EVERY} steps with its clock stopped (`benchmarks/trl_runner.py`); "
                          f"target {args.long_tail_target}.")
    report = "\n".join(["# rlplatform vs TRL", "",
                        f"{date.today()}, {platform.node()}: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
                        f"`{' '.join(['python benchmarks/vs_trl.py', *sys.argv[1:]])}`", "",
                        f"Shared base: greedy test accuracy {info['greedy_test_accuracy']:.3f} after "
                        f"{info['sft_steps']} SFT steps (make_base.py, seed {info['seed']}). Both systems: "
                        f"{PROMPTS} prompts x {GROUP} completions per step, lr {LR} decaying linearly to 0, at most "
                        f"{COMPLETION_TOKENS} completion tokens (scenario 3: more), temperature 1, no KL term.", "",
                        *sections])
    print(report)
    with open(args.out, "w") as f:
        f.write(report)


if __name__ == "__main__":
    main()
