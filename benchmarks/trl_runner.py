"""TRL's GRPOTrainer with the settings of ../shared/bench/trl_peer.py, a completion limit and a
reward cost of choice and, optionally, held-out evaluation during training.

The shared peer fixes `max_completion_length=6`, which suits the addition task but cuts the
long-tail task's worked answers, and evaluates only before and after training; this runner is
that peer with the limit (and the greedy evaluation's token budget) as an argument and, with
`--eval-every N`, the greedy accuracy every N steps dated in training seconds (the evaluations'
own time is left out), for the time-to-target figures of `vs_trl.py`. The reward is the peer's
exact match; `--reward-delay-ms` sleeps per completion exactly as the peer does (a remote judge,
called in sequence), `--reward-cpu-ms` computes per completion instead (`bench_rewards.burn_cpu`).
Prints one JSON line in the peer's format, plus `eval_history` as [step, train seconds, accuracy]
rows and `startup_s`: seconds from the process's start to the first training step.

Usage: python benchmarks/trl_runner.py BASE_DIR --max-completion-length 40 [--steps N] [--prompts P]
           [--group G] [--lr LR] [--eval-every N] [--eval-tokens T] [--reward-delay-ms MS]
           [--reward-cpu-ms MS] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import psutil
import torch
from bench_rewards import burn_cpu  # benchmarks/bench_rewards.py, beside this script
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "..", "shared", "bench"))
from make_base import accuracy  # noqa: E402


def exact_match_costing(delay_ms: float, cpu_ms: float):
    """The peer's exact match, with `delay_ms` of sleep (as trl_peer.py) or `cpu_ms` of hashing per completion."""
    def exact_match(completions, answer, **_):
        if delay_ms:
            time.sleep(delay_ms / 1000 * len(completions))
        for _ in completions if cpu_ms else ():
            burn_cpu(cpu_ms)
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]
    return exact_match


class HeldOutAccuracy(TrainerCallback):
    """Greedy test accuracy every `every` steps, dated in training time: the clock stops while it evaluates."""

    def __init__(self, tokenizer, rows, every: int, max_new_tokens: int) -> None:
        self.tokenizer, self.rows, self.every, self.max_new_tokens = tokenizer, rows, every, max_new_tokens
        self.history, self.eval_s, self.start, self.first_step_at = [], 0.0, None, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.time()

    def on_step_begin(self, args, state, control, **kwargs):
        self.first_step_at = self.first_step_at or time.time()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.every and state.global_step % self.every == 0:
            began = time.time()
            acc = accuracy(model, self.tokenizer, self.rows, max_new_tokens=self.max_new_tokens)
            self.history.append([state.global_step, round(began - self.start - self.eval_s, 2), acc])
            self.eval_s += time.time() - began


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("base")
    parser.add_argument("--max-completion-length", type=int, required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--eval-every", type=int, default=0, help="held-out accuracy every N steps (0: none)")
    parser.add_argument("--eval-tokens", type=int, help="greedy evaluation's token budget (default: the limit)")
    parser.add_argument("--reward-delay-ms", type=float, default=0.0, help="sleep per completion (a remote judge)")
    parser.add_argument("--reward-cpu-ms", type=float, default=0.0, help="CPU time per completion (a local verifier)")
    parser.add_argument("--seed", type=int, default=0, help="torch's and GRPOTrainer's seed")
    parser.add_argument("--out", default="/tmp/trl_runner_out")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.base)
    model = AutoModelForCausalLM.from_pretrained(args.base)
    rows = [json.loads(line) for line in open(os.path.join(args.base, "train.jsonl"))]
    test = [json.loads(line) for line in open(os.path.join(args.base, "test.jsonl"))]
    eval_tokens = args.eval_tokens or args.max_completion_length
    acc_before = accuracy(model, tokenizer, test, max_new_tokens=eval_tokens)
    config = GRPOConfig(output_dir=args.out, max_steps=args.steps, learning_rate=args.lr,
                        per_device_train_batch_size=args.prompts * args.group, num_generations=args.group,
                        max_completion_length=args.max_completion_length, temperature=1.0, beta=0.0,
                        logging_steps=5, save_strategy="no", report_to=[], use_cpu=True, bf16=False, seed=args.seed)
    evaluation = HeldOutAccuracy(tokenizer, test, args.eval_every, eval_tokens)
    reward = exact_match_costing(args.reward_delay_ms, args.reward_cpu_ms)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, callbacks=[evaluation])
    start = time.time()
    trainer.train()
    wall = time.time() - start - evaluation.eval_s
    acc_after = accuracy(trainer.model, tokenizer, test, max_new_tokens=eval_tokens)
    completions = args.steps * args.prompts * args.group
    print(json.dumps({"peer": "trl", "steps": args.steps, "completions": completions, "wall_s": round(wall, 1),
                      "completions_per_s": round(completions / wall, 1), "acc_before": acc_before,
                      "acc_after": acc_after, "eval_history": evaluation.history,
                      "startup_s": round(evaluation.first_step_at - psutil.Process().create_time(), 2)}))


if __name__ == "__main__":
    main()
