"""Accelerator figures for a small real-architecture policy: generation tokens/s (rlplatform's
transformers engine, and vLLM when it is installed and CUDA is present), weight sync seconds per GB
(learner snapshot -> Ray object store -> engine), and learner tokens/s (one DeepSpeed learner rank,
in this process, running the RL step the jobs run).

The policy is a Qwen2-architecture model built from config with random weights (`--size 0.5b`:
Qwen2-0.5B's shapes, 151,936-token vocabulary) and a word-level tokenizer over the same ids, so
nothing is downloaded. Without CUDA every figure but vLLM's is measured on CPU, which is how the
test suite checks this script at `--size tiny`.

Usage: python benchmarks/gpu.py [--size 0.5b|tiny] [--prompts 64] [--group 8] [--new-tokens 128]
           [--learner-steps 3] [--out benchmarks/results/gpu.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import socket
import sys
import tempfile
import time
from datetime import date
from typing import Dict, List

import ray
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from rlplatform.actors.engine import TransformersEngine
from rlplatform.config import LearnerConfig, RLConfig
from rlplatform.learners.algorithms import grpo_advantages
from rlplatform.learners.rank import LearnerRank
from rlplatform.transport.samples import Sample
from rlplatform.transport.weights import from_snapshot

SIZES = {  # Qwen2Config fields
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2),
}
PROMPT_TOKENS = 32


def build_policy(size: str, out: str) -> str:
    """Save a random-weight Qwen2 of `size` and a word-level tokenizer covering its vocabulary."""
    fields = SIZES[size]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, fields["vocab_size"])}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   padding_side="left")
    torch.manual_seed(0)
    config = Qwen2Config(**fields, max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_id=2, pad_token_id=0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    fast.save_pretrained(out)
    return out


def random_prompts(n: int, vocab_size: int, seed: int = 0) -> List[str]:
    rng = random.Random(seed)
    return [" ".join(f"t{rng.randrange(3, vocab_size)}" for _ in range(PROMPT_TOKENS)) for _ in range(n)]


def engine_generation(engine: TransformersEngine, prompts: List[str], group: int, new_tokens: int) -> Dict:
    prompts = engine.tokenizer(prompts)["input_ids"]
    engine.generate(prompts[:2], 1, 4, 1.0)  # warm-up
    _synchronize()
    start = time.perf_counter()
    groups = engine.generate(prompts, group, new_tokens, 1.0)
    _synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(c.completion_ids) for g in groups for c in g)
    return {"tokens": tokens, "seconds": seconds, "groups": groups}


def vllm_generation(model_dir: str, prompts: List[str], group: int, new_tokens: int) -> Dict:
    """vLLM on the same weights and prompts, EOS ignored like a random model's rare EOS; needs CUDA."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", gpu_memory_utilization=0.5, seed=0)
    params = SamplingParams(n=group, temperature=1.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return {"tokens": sum(len(o.token_ids) for out in outputs for o in out.outputs), "seconds": seconds}


def weight_sync(learner: LearnerRank, engine: TransformersEngine, repeats: int = 5) -> Dict:
    """Snapshot the learner's weights into the object store and load them into the engine, as a job does."""
    seconds = []
    for version in range(repeats):
        _synchronize()
        start = time.perf_counter()
        snapshot = ray.get(learner.publish_weights()[0])
        engine.load_weights(from_snapshot(snapshot), version)
        _synchronize()
        seconds.append(time.perf_counter() - start)
    gigabytes = sum(array.nbytes for array in snapshot.values()) / 1e9
    return {"gigabytes": gigabytes, "best_s": min(seconds), "median_s": sorted(seconds)[len(seconds) // 2]}


def learner_steps(learner: LearnerRank, groups, steps: int) -> Dict:
    """RL steps on the generated groups with random rewards; tokens are prompt + completion tokens fed."""
    rng = random.Random(0)
    samples = [Sample(sample_id=f"g{g}/{i}", group_id=f"g{g}", policy="policy", prompt="", completion=c.text,
                      prompt_ids=c.prompt_ids, completion_ids=c.completion_ids, behaviour_logprobs=c.logprobs,
                      token_versions=c.versions, row={})
               for g, group in enumerate(groups) for i, c in enumerate(group)]
    rewards = [[float(rng.random() < 0.5) for _ in group] for group in groups]
    advantages = [a for group in grpo_advantages(rewards) for a in group]
    rl = RLConfig(lr_schedule="constant", max_new_tokens=max(len(s.completion_ids) for s in samples))
    learner.rl_step(samples, advantages, rl)  # warm-up
    _synchronize()
    start = time.perf_counter()
    for step in range(steps):
        learner.rl_step(samples, advantages, rl, step=step)
    _synchronize()
    seconds = time.perf_counter() - start
    tokens = steps * sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    return {"tokens": tokens, "seconds": seconds}


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=sorted(SIZES), default="0.5b")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--learner-steps", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "gpu.md"))
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model_dir = build_policy(args.size, tempfile.mkdtemp())
    prompts = random_prompts(args.prompts, SIZES[args.size]["vocab_size"])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    engine = TransformersEngine(model_dir, device)
    engine.version = 0
    generated = engine_generation(engine, prompts, args.group, args.new_tokens)
    try:
        vllm = vllm_generation(model_dir, prompts, args.group, args.new_tokens) if device == "cuda" else None
        vllm_note = "" if vllm else "not measured: needs CUDA"
    except ImportError:
        vllm, vllm_note = None, "not measured: vllm is not installed"
    learner = LearnerRank(0, 1, model_dir, LearnerConfig(zero_stage=1, num_threads=torch.get_num_threads()), seed=0)
    learner.setup("127.0.0.1", _free_port())
    learner.start_stage(lr=1e-6)
    sync = weight_sync(learner, engine)
    trained = learner_steps(learner, generated["groups"], args.learner_steps)
    params = sum(p.numel() for p in engine.model.parameters())
    name = torch.cuda.get_device_name() if device == "cuda" else f"CPU ({os.cpu_count()} cores)"
    rows = [("generation, rlplatform transformers engine (float32)",
             f"{generated['tokens'] / generated['seconds']:.0f} tokens/s",
             f"{args.prompts} prompts x {args.group}, up to {args.new_tokens} new tokens"),
            ("generation, vLLM (float32)", f"{vllm['tokens'] / vllm['seconds']:.0f} tokens/s" if vllm else vllm_note,
             "same prompts, EOS ignored"),
            ("weight sync", f"{sync['best_s'] / sync['gigabytes']:.2f} s/GB",
             f"{sync['gigabytes'] * 1000:.1f} MB snapshot -> object store -> engine, best of 5 "
             f"(median {sync['median_s'] / sync['gigabytes']:.2f} s/GB)"),
            ("learner (DeepSpeed ZeRO-1, one rank)", f"{trained['tokens'] / trained['seconds']:.0f} tokens/s",
             f"{args.learner_steps} RL steps on the generated groups")]
    report = "\n".join([
        "# Accelerator figures", "",
        f"{date.today()}, {platform.node()}: {name}, torch {torch.__version__}, "
        f"`{' '.join(['python benchmarks/gpu.py', *sys.argv[1:]])}`", "",
        f"Policy: Qwen2 architecture, {args.size} shapes, {params / 1e6:.1f}M parameters, random weights.", "",
        "| measure | figure | how |", "|---|---|---|", *[f"| {a} | {b} | {c} |" for a, b, c in rows], ""])
    print(report)
    with open(args.out, "w") as f:
        f.write(report)


if __name__ == "__main__":
    main()
