"""Prompt data: rows of {"prompt", "answer", ...} that rollout workers sample and eval scores.

The demo task generates integer addition rows ("37+48=" -> "85") from a seed, so a job needs
no download. Its test rows are fresh draws from the same problem space as the training rows
(so they measure task accuracy, and may repeat a trained problem) unless `data.disjoint_test`
holds out distinct problems that no training row repeats (generalisation to unseen problems).
`kind: jsonl` reads the same row shape from files.
"""

from __future__ import annotations

import json
import random
from typing import Dict, FrozenSet, List, Tuple

from rlplatform.config import DataConfig

Row = Dict[str, str]


def addition_rows(count: int, rng: random.Random, digits: int = 2,
                  exclude: FrozenSet[Tuple[int, int]] = frozenset(), distinct: bool = False) -> List[Row]:
    """`count` rows "a+b=" -> str(a+b) with operands of up to `digits` digits, none of whose
    operand pairs is in `exclude`; with `distinct`, no pair appears twice."""
    high = 10 ** digits - 1
    if count + len(exclude) > (high + 1) ** 2 and distinct:
        raise ValueError(f"only {(high + 1) ** 2} distinct {digits}-digit additions exist; asked for {count}")
    rows, seen = [], set(exclude)
    while len(rows) < count:
        a, b = rng.randint(0, high), rng.randint(0, high)
        if (a, b) in seen:
            continue
        if distinct:
            seen.add((a, b))
        rows.append({"prompt": f"{a}+{b}=", "answer": str(a + b)})
    return rows


def _pair(row: Row) -> Tuple[int, int]:
    a, b = row["prompt"].rstrip("=").split("+")
    return int(a), int(b)


def read_jsonl(path: str) -> List[Row]:
    rows = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_no}: not valid JSON: {err.msg} (column {err.colno})") from None
            if not isinstance(row, dict) or "prompt" not in row:
                raise ValueError(f"{path}:{line_no}: each row needs a 'prompt' field")
            rows.append(row)
    return rows


def load_rows(config: DataConfig, seed: int) -> Tuple[List[Row], List[Row]]:
    """(train rows, held-out test rows) for a job."""
    if config.kind == "jsonl":
        return read_jsonl(config.train_path), read_jsonl(config.test_path)
    rng = random.Random(seed)
    if not config.disjoint_test:
        train = addition_rows(config.train_size, rng, config.digits)
        return train, addition_rows(config.test_size, rng, config.digits)
    test = addition_rows(config.test_size, rng, config.digits, distinct=True)
    train = addition_rows(config.train_size, rng, config.digits, exclude=frozenset(map(_pair, test)))
    return train, test
