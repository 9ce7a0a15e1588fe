"""The long-tail task of `vs_trl.py`: addition where one prompt in eight asks for a worked answer.

Most rows are the shared base's `37+48=` -> `85` (three tokens with EOS); the others are
`37*4=` -> `37+37+37+37=148`, a product written out as a sum, up to 31 characters. Sampled
completion lengths then vary by ten times within every batch, as in a prompt format where a
few answers run long. `build` fine-tunes the shared base on this mix, briefly, so that both
systems start from weights that already write both forms.

Usage: python benchmarks/long_tail.py SHARED_BASE OUT_DIR [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import random
from typing import Dict, List

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

LONG_EVERY = 8  # one row in LONG_EVERY is a worked product
MAX_COMPLETION_TOKENS = 40  # the longest answer (31 characters) and EOS fit with room to run on


def worked_product(rng: random.Random) -> Dict[str, str]:
    a, b = rng.randint(10, 99), rng.randint(2, 9)
    return {"prompt": f"{a}*{b}=", "answer": "+".join([str(a)] * b) + f"={a * b}"}


def mix(rows: List[Dict], rng: random.Random) -> List[Dict]:
    """`rows` with every LONG_EVERY-th replaced by a worked product."""
    return [worked_product(rng) if i % LONG_EVERY == LONG_EVERY - 1 else row for i, row in enumerate(rows)]


def build(shared_base: str, out: str, steps: int, seed: int = 0) -> Dict:
    """Fine-tune the shared base on the long-tail mix; writes model, tokenizer and data to `out`."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    data = {name: mix([json.loads(line) for line in open(os.path.join(shared_base, f"{name}.jsonl"))], rng)
            for name in ("train", "test")}
    tokenizer = AutoTokenizer.from_pretrained(shared_base)
    model = AutoModelForCausalLM.from_pretrained(shared_base)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        batch = rng.sample(data["train"], 128)
        encoded = tokenizer([r["prompt"] + r["answer"] + tokenizer.eos_token for r in batch], return_tensors="pt",
                            padding=True)
        labels = encoded["input_ids"].masked_fill(encoded["attention_mask"] == 0, -100)
        model(**encoded, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for name, rows in data.items():
        with open(os.path.join(out, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    info = {"fine_tune_steps": steps, "seed": seed, "long_every": LONG_EVERY,
            "max_completion_tokens": MAX_COMPLETION_TOKENS}
    with open(os.path.join(out, "long_tail_info.json"), "w") as f:
        json.dump(info, f)
    return info


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("shared_base")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    print(build(args.shared_base, args.out, args.steps))


if __name__ == "__main__":
    main()
