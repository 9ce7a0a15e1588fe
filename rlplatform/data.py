"""Prompt data: rows of {"prompt", "answer", ...} that rollout workers sample and eval scores.

The demo task generates integer addition rows ("37+48=" -> "85") from a seed, so a job needs
no download; `kind: jsonl` reads the same row shape from files.
"""

from __future__ import annotations

import json
import random
from typing import Dict, List, Tuple

from rlplatform.config import DataConfig

Row = Dict[str, str]


def addition_rows(count: int, rng: random.Random, digits: int = 2) -> List[Row]:
    """`count` rows "a+b=" -> str(a+b) with operands of up to `digits` digits."""
    high = 10 ** digits - 1
    rows = []
    for _ in range(count):
        a, b = rng.randint(0, high), rng.randint(0, high)
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def read_jsonl(path: str) -> List[Row]:
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or "prompt" not in row:
                raise ValueError(f"{path}:{line_no}: each row needs a 'prompt' field")
            rows.append(row)
    return rows


def load_rows(config: DataConfig, seed: int) -> Tuple[List[Row], List[Row]]:
    """(train rows, held-out test rows) for a job."""
    if config.kind == "jsonl":
        return read_jsonl(config.train_path), read_jsonl(config.test_path)
    rng = random.Random(seed)
    train = addition_rows(config.train_size, rng, config.digits)
    test = addition_rows(config.test_size, rng, config.digits)
    return train, test
