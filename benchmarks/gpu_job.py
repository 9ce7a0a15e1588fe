"""The whole job on one device beside TRL's GRPOTrainer on the same device, for `gpu.py`'s job rows.

Both train the same random-weight policy (`gpu.py`'s Qwen2 shapes) on the same prompts with the
same group size, completion limit and reward, and both are measured in trained completions per
second of training wall time. The reward is a coin flip for a random policy (the first completion
token's id ends in 0-4), so almost every group carries signal and neither side skips work.

- rlplatform: `rlp run` of a generated config in its own process: SFT off, asynchronous GRPO with
  one learner rank and two rollout workers, everything else the defaults: on one GPU the job shares
  it (learner 0.5, each worker and the evaluator a sixth) and syncs weights by CUDA IPC, in
  `model.dtype: auto` with the memory defaults. Its figures
  come from the run's summary.json: trained samples/s over the RL stage, the learner's busy
  fraction, seconds per weight sync.
- TRL: GRPOTrainer (Hugging Face generation; on CUDA its `bf16` mixed precision, autocast over float32
  weights, where ours trains bfloat16 weights over float32 masters, each framework's bf16 default) in its
  own process, one optimizer step per prompts x group completions as ours (per-device batch `prompts`,
  `group` accumulation steps), beta 0 as ours tracks but does not apply a KL penalty. Wall time is
  `trainer.train()`'s.

Usage (as gpu.py calls it): python benchmarks/gpu_job.py trl MODEL_DIR DATA_JSONL --steps N
           --prompts P --group G --new-tokens T
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from typing import Dict, List, Tuple

import yaml

REWARD_PATTERN = r"^\s*t\d*[0-4]\b"


def write_rows(path: str, prompts: List[str]) -> str:
    with open(path, "w") as f:
        for prompt in prompts:
            f.write(json.dumps({"prompt": prompt, "answer": ""}) + "\n")
    return path


def job_figures(model_dir: str, prompts: List[str], group: int, new_tokens: int, steps: int, work_dir: str,
                timeout_s: float) -> Dict:
    """Trained samples/s, learner busy fraction and seconds per sync of `rlp run` on these prompts, with the
    default devices, GPU shares and weight transport."""
    data = write_rows(os.path.join(work_dir, "prompts.jsonl"), prompts)
    config = {
        "name": "gpu-job", "output_dir": os.path.join(work_dir, "runs"),
        "model": {"kind": "pretrained", "path": model_dir},
        "data": {"kind": "jsonl", "train_path": data, "test_path": data},
        "sft": {"enabled": False},
        "rl": {"max_steps": steps, "batch_prompts": len(prompts), "group_size": group, "max_new_tokens": new_tokens,
               "lr": 1e-6, "lr_schedule": "constant", "log_every": 1},
        "rollout": {"num_workers": 2, "prompts_per_batch": len(prompts)},
        "rewards": [{"name": "regex_contains", "params": {"pattern": REWARD_PATTERN}}],
        "eval": {"enabled": False},  # like the peer, which evaluates nothing: no evaluator takes a GPU share
        "wandb": {"mode": "disabled"},
    }
    path = os.path.join(work_dir, "gpu-job.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    lines = timed_output(["rlp", "run", path], timeout_s)
    if lines[-1][1] != "exit 0":
        raise RuntimeError(f"rlp run {lines[-1][1]}: {[line for _, line in lines[-4:-1]]}")
    with open(os.path.join(work_dir, "runs", "gpu-job", "summary.json")) as f:
        summary = json.load(f)
    rl, startup = summary["rl"], summary["startup_s"]
    syncs = max(rl["weight_syncs"], 1)
    ends = [t for t, line in lines if re.match(r"stage rl +step [1-9]", line)]  # when each RL step ended
    per_step = rl["samples_trained"] / max(rl["steps"], 1)
    return {"trained_per_s": rl["trained_per_s"], "learner_busy": rl["learner_busy_fraction"],
            "sync_s": rl["weight_sync_s"] / syncs, "steps": rl["steps"], "trained": rl["samples_trained"],
            "mfu": rl["learner_mfu"], "actors_ready_s": startup["workers_ready_s"],
            "first_step_s": startup["to_first_rl_step_s"],
            "shares": next((line for _, line in lines if line.startswith("sharing ")), None),  # the job's GPU shares
            "after_first_per_s": (len(ends) - 1) * per_step / (ends[-1] - ends[0]) if len(ends) > 1 else None,
            "progress": [f"{t:6.1f} s  {line}" for t, line in lines if line.startswith("stage")]}


def timed_output(command: List[str], timeout_s: float) -> List[Tuple[float, str]]:
    """(seconds since the start, line) of each line the command prints (stderr with stdout), then its exit."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = threading.Timer(timeout_s, process.kill)
    deadline.start()
    lines = [(time.perf_counter() - start, line.rstrip()) for line in process.stdout]
    process.wait()
    deadline.cancel()
    return lines + [(time.perf_counter() - start, f"exit {process.returncode}")]


def trl_figures(model_dir: str, prompts: List[str], group: int, new_tokens: int, steps: int, work_dir: str,
                timeout_s: float) -> Dict:
    """TRL's figures from its own process (its GPU memory goes with it)."""
    data = write_rows(os.path.join(work_dir, "trl_prompts.jsonl"), prompts)
    command = [sys.executable, os.path.abspath(__file__), "trl", model_dir, data, "--steps", str(steps),
               "--prompts", str(len(prompts)), "--group", str(group), "--new-tokens", str(new_tokens)]
    done = subprocess.run(command, timeout=timeout_s, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def coin_flip(completions, **_) -> List[float]:
    """The job's reward in TRL's signature: regex_contains with REWARD_PATTERN."""
    return [float(re.search(REWARD_PATTERN, c) is not None) for c in completions]


def _trl_main(args: argparse.Namespace) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlplatform.policy import load_tokenizer  # the saved tokenizer.json (AutoTokenizer would pick Qwen2's)

    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    tokenizer = load_tokenizer(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir)
    rows = [json.loads(line) for line in open(args.data)]
    config = GRPOConfig(output_dir=os.path.join(os.path.dirname(args.data), "trl_out"), max_steps=args.steps,
                        learning_rate=1e-6, lr_scheduler_type="constant", per_device_train_batch_size=args.prompts,
                        gradient_accumulation_steps=args.group, num_generations=args.group,
                        max_completion_length=args.new_tokens, temperature=1.0, beta=0.0, logging_steps=1,
                        save_strategy="no", report_to=[], use_cpu=not cuda, bf16=cuda, seed=0)
    trainer = GRPOTrainer(model=model, reward_funcs=coin_flip, args=config,
                          train_dataset=Dataset.from_list(rows * (args.steps * args.group)),
                          processing_class=tokenizer)
    step_ends: List[float] = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, *_, **__):
            step_ends.append(time.time())

    trainer.add_callback(StepEnds())
    start = time.time()
    trainer.train()
    wall = time.time() - start
    completions = args.steps * args.prompts * args.group
    after_first = (len(step_ends) - 1) * args.prompts * args.group / (step_ends[-1] - step_ends[0]) \
        if len(step_ends) > 1 else None
    print(json.dumps({"steps": args.steps, "trained": completions, "wall_s": round(wall, 1),
                      "trained_per_s": round(completions / wall, 1), "after_first_per_s": after_first}))


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    trl = sub.add_parser("trl")
    trl.add_argument("model_dir")
    trl.add_argument("data")
    for name in ("steps", "prompts", "group", "new_tokens"):
        trl.add_argument(f"--{name.replace('_', '-')}", type=int, required=True)
    _trl_main(parser.parse_args())


if __name__ == "__main__":
    main()
