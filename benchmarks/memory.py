"""Peak learner memory of one RL step against completion length: a Qwen2-architecture policy with the
151,936-token vocabulary and a small body, 128 completions (16 prompts x 8) of 128, 256 and 512 tokens,
scored with chunked output-head log-probs and the default `learner.micro_batch_tokens` (a budget from
the device's free memory; `--micro-batch-tokens` sets one instead; `--prompts` sets the groups). Each
setting runs in a fresh process (one DeepSpeed rank at its default ZeRO-0, no Ray) whose peak RSS (on CUDA: max
allocated) is its figure, beside the memory the budget allows its step. Writes results/memory.md.

    python benchmarks/memory.py                       # 128, 256, 512 completion tokens
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import resource
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

VOCAB = 151_936
GROUP, PROMPT_TOKENS = 8, 32
HERE = os.path.dirname(os.path.abspath(__file__))


def build_policy(out_dir: str, hidden: int) -> str:
    """A freshly initialised Qwen2 policy with Qwen's vocabulary size and a `hidden`-wide, 2-layer body."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlplatform.policy import demo_tokenizer

    tokenizer = demo_tokenizer()  # the learner needs only its pad id; token ids range over the whole vocabulary
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    Qwen2ForCausalLM(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def one_step(policy: str, prompts: int, completion_tokens: int, micro_batch_tokens: Optional[int], threads: int) -> Dict:
    """Child process: set up one learner rank, run one RL step, report its memory."""
    import torch

    from rlplatform.config import LearnerConfig, RLConfig
    from rlplatform.learners.budget import MEMORY_FRACTION, free_device_bytes
    from rlplatform.learners.rank import LearnerRank
    from rlplatform.transport.samples import Sample
    from rlplatform.transport.weight_transports import ObjectStoreTransport

    rank = LearnerRank(0, 1, policy, LearnerConfig(micro_batch_tokens=micro_batch_tokens, num_threads=threads), 0,
                       dtype="float32", transport=ObjectStoreTransport())
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    rank.setup("127.0.0.1", port)
    free = free_device_bytes(rank.device, 1, None)
    rank.start_stage(lr=1e-5)
    rng = random.Random(0)
    samples, advantages = [], []
    for p in range(prompts):
        prompt = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]
        for g in range(GROUP):
            completion = [rng.randrange(VOCAB) for _ in range(completion_tokens)]
            samples.append(Sample(f"{p}/{g}", str(p), "policy", "", "", prompt_ids=prompt, completion_ids=completion,
                                  behaviour_logprobs=[-12.0] * completion_tokens,
                                  token_versions=[0] * completion_tokens))
            advantages.append(1.0 if g % 2 else -1.0)
    before = rss_mb()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    metrics = rank.rl_step(samples, advantages, RLConfig(kl_coef=0.0, track_reference_kl=False))
    result = {"completion_tokens": completion_tokens, "rss_before_step_mb": round(before),
              "micro_batch_tokens": rank.micro_batch_tokens, "micro_batches": len(rank._plan(
                  samples, advantages, 1, True, completion_tokens, step=0)[0].parts),
              "step_allowance_mb": round(MEMORY_FRACTION * free / 2 ** 20),
              "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
              "step_s": round(time.perf_counter() - start, 1), "loss": metrics["loss"]}
    if torch.cuda.is_available():
        result["cuda_peak_allocated_mb"] = round(torch.cuda.max_memory_allocated() / 2 ** 20)
    return result


def write_table(rows: List[Dict], args: argparse.Namespace, command: str) -> str:
    lines = [
        "# Peak learner memory of one RL step",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.platform()}; "
        f"{'CUDA' if 'cuda_peak_allocated_mb' in rows[0] else 'CPU only'}. "
        f"Date: {datetime.date.today().isoformat()}. Command: `{command}`.",
        "",
        f"Policy: Qwen2 architecture, vocabulary {VOCAB:,}, hidden {args.hidden}, 2 layers, tied embeddings, float32. "
        f"Batch: {args.prompts} prompts x {GROUP} completions = {args.prompts * GROUP} completions, prompts of {PROMPT_TOKENS} "
        f"tokens; one optimizer step (1 minibatch, 1 epoch), `learner.micro_batch_tokens: "
        f"{args.micro_batch_tokens or 'unset (the default: from free memory)'}`, "
        "log-probs through the output head in chunks (`learners/batching.py`, LOGIT_CHUNK_ELEMENTS). "
        "Each setting runs in a fresh process; peak RSS is that process's `ru_maxrss` (everything: Python, torch, "
        "DeepSpeed, the model and its AdamW state, the step).",
        "",
        "The budget gives one micro-batch's activations at most half the memory free after set-up "
        "(`learners/budget.py`); the allowance column is that half, the growth column what the step took beyond "
        "the memory held before it.",
        "",
        "| completion tokens | micro-batch tokens | micro-batches | RSS before the step (MB) | peak RSS (MB) "
        "| step growth (MB) | allowance (MB) | within it | ratio to the previous row | step (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    previous = None
    for row in rows:
        ratio = f"{row['peak_rss_mb'] / previous:.2f}" if previous else "-"
        growth = row["peak_rss_mb"] - row["rss_before_step_mb"]
        lines.append(f"| {row['completion_tokens']} | {row['micro_batch_tokens']} | {row['micro_batches']} "
                     f"| {row['rss_before_step_mb']} | {row['peak_rss_mb']} | {growth} | {row['step_allowance_mb']} "
                     f"| {'yes' if growth <= row['step_allowance_mb'] else 'NO'} | {ratio} | {row['step_s']} |")
        previous = row["peak_rss_mb"]
    if "cuda_peak_allocated_mb" in rows[0]:
        lines += ["", "CUDA max allocated (MB): " + ", ".join(
            f"{r['completion_tokens']} tokens: {r['cuda_peak_allocated_mb']}" for r in rows)]
    longest = rows[-1]["completion_tokens"]
    logits_gb = args.prompts * GROUP * (PROMPT_TOKENS + longest) * VOCAB * 4 / 1e9
    full_gb = 16 * GROUP * (PROMPT_TOKENS + 512) * VOCAB * 4 / 1e9
    lines += ["", "Not measured: the unchunked computation (full-vocabulary float32 logits, log-softmax and entropy "
              "for the whole batch at once), which this script does not run. Its float32 logits alone are "
              f"{args.prompts * GROUP} x {PROMPT_TOKENS + longest} x {VOCAB:,} x 4 bytes = {logits_gb:.1f} GB for this "
              f"batch at {longest} tokens ({full_gb:.0f} GB for 128 completions of 512), and the log-softmax, the "
              "entropy and the backward each hold tensors of that size."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--prompts", type=int, default=16, help="groups of 8 completions")
    parser.add_argument("--micro-batch-tokens", type=int, default=None, help="default: unset, the learner's budget")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        policy, tokens = json.loads(args.child)
        print(json.dumps(one_step(policy, args.prompts, tokens, args.micro_batch_tokens, args.threads)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        policy = build_policy(tmp, args.hidden)
        for tokens in args.tokens:
            budget = ["--micro-batch-tokens", str(args.micro_batch_tokens)] if args.micro_batch_tokens else []
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps([policy, tokens]),
                                  "--prompts", str(args.prompts), *budget, "--hidden", str(args.hidden),
                                  "--threads", str(args.threads)], capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    command = "python benchmarks/memory.py " + " ".join(sys.argv[1:])
    table = write_table(rows, args, command.strip())
    with open(os.path.join(HERE, "results", "memory.md"), "w") as f:
        f.write(table)
    print(table)


if __name__ == "__main__":
    main()
