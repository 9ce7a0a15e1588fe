"""Learner throughput at the quickstart's size: trained samples/s of one DeepSpeed rank (ZeRO-0,
gloo, in this process, no Ray) running the quickstart's RL step (GRPO, 16 prompts x 8 completions
of 2-digit additions, KL to the frozen reference tracked) on its 0.8M-parameter demo policy.
Process CPU time per step is reported beside wall time: it is far less sensitive to other load on a
shared machine. `--profile` prints torch.profiler's table of one step instead of timing. `--compile`
times a second rank with `learner.compile: true` on the same batches (its set-up compiles the layers).

Usage: python benchmarks/learner_step.py [--steps 30] [--threads 1] [--profile] [--compile]
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import tempfile
import time
from typing import List, Tuple

import torch

from rlplatform.config import LearnerConfig, ModelConfig, RLConfig
from rlplatform.learners.rank import LearnerRank
from rlplatform.policy import save_initial_policy
from rlplatform.transport.samples import Sample
from rlplatform.transport.weight_transports import ObjectStoreTransport

PROMPTS, GROUP = 16, 8


def quickstart_batch(tokenizer, step: int, seed: int) -> Tuple[List[Sample], List[float]]:
    """16 addition prompts with 8 completions each (answers of 1-3 digits + EOS, some wrong)."""
    rng = random.Random(seed)
    samples, advantages = [], []
    for p in range(PROMPTS):
        a, b = rng.randrange(10, 100), rng.randrange(10, 100)
        prompt = tokenizer(f"{a}+{b}=")["input_ids"]
        for g in range(GROUP):
            answer = str(a + b + rng.choice([0, 0, 1, -1, 10]))[:rng.choice([1, 2, 3, 3])]
            completion = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            samples.append(Sample(f"{p}/{g}", str(p), "policy", "", answer, prompt_ids=prompt,
                                  completion_ids=completion,
                                  behaviour_logprobs=[-1.0] * len(completion), token_versions=[step] * len(completion)))
            advantages.append(rng.choice([1.0, -1.0]))
    return samples, advantages


def learner_rank(policy: str, threads: int, compile_layers: bool = False) -> LearnerRank:
    rank = LearnerRank(0, 1, policy, LearnerConfig(num_threads=threads, compile=compile_layers), seed=0,
                       dtype="float32", transport=ObjectStoreTransport())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    rank.setup("127.0.0.1", port)
    rank.start_stage(lr=3e-4, keep_reference=True)
    return rank


def timed_steps(rank: LearnerRank, batches, rl: RLConfig, first: int) -> Tuple[float, float]:
    """(median wall seconds, median process CPU seconds) of RL steps on `batches[first:]`."""
    seconds, cpu_seconds = [], []
    for step in range(first, len(batches)):
        start, cpu_start = time.perf_counter(), time.process_time()
        rank.rl_step(*batches[step], rl, step=step)
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
    return statistics.median(seconds), statistics.median(cpu_seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--compile", action="store_true", help="also time a rank with compiled decoder layers")
    args = parser.parse_args()
    rl = RLConfig(max_steps=400, batch_prompts=PROMPTS, group_size=GROUP, lr=3e-4)
    with tempfile.TemporaryDirectory() as out_dir:
        policy = save_initial_policy(ModelConfig(), 0, os.path.join(out_dir, "policy"))
        start = time.perf_counter()
        rank = learner_rank(policy, args.threads)
        setup_s = time.perf_counter() - start
        compiled = learner_rank(policy, args.threads, compile_layers=True) if args.compile else None
        compiled_setup_s = time.perf_counter() - start - setup_s
    batches = [quickstart_batch(rank.tokenizer, step, seed=step) for step in range(args.steps + 3)]
    for step in range(3):  # warm-up
        rank.rl_step(*batches[step], rl, step=step)
    if args.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
            rank.rl_step(*batches[3], rl, step=3)
        print(profiler.key_averages().table(sort_by="cpu_time_total", row_limit=40))
        return
    median, cpu = timed_steps(rank, batches, rl, 3)
    print(f"{args.steps} steps of {PROMPTS * GROUP} samples: median {median * 1000:.1f} ms/step wall "
          f"({PROMPTS * GROUP / median:.0f} samples/s), {cpu * 1000:.1f} ms/step process CPU "
          f"({PROMPTS * GROUP / cpu:.0f} samples per CPU second), load average {os.getloadavg()[0]:.1f}")
    if compiled is not None:
        for step in range(3):  # warm-up, as the eager rank's
            compiled.rl_step(*batches[step], rl, step=step)
        compiled_median, compiled_cpu = timed_steps(compiled, batches, rl, 3)
        print(f"compiled layers ({compiled.compiled_layers}): median {compiled_median * 1000:.1f} ms/step wall, "
              f"{compiled_cpu * 1000:.1f} ms/step process CPU ({compiled_cpu / cpu:.2f}x the eager rank's); "
              f"its set-up, which compiles them, took {compiled_setup_s:.1f} s (the eager rank's {setup_s:.1f} s)")


if __name__ == "__main__":
    main()
