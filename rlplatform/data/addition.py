"""The demo task's data: integer addition rows ("37+48=" -> "85") generated from a seed.

A job on it needs no download. Its test rows are fresh draws from the same problem space as the training rows
(so they measure task accuracy, and may repeat a trained problem) unless `data.disjoint_test`
holds out distinct problems that no training row repeats (generalisation to unseen problems).
"""

from __future__ import annotations

import random
from typing import Dict, FrozenSet, List, Tuple

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


def pair(row: Row) -> Tuple[int, int]:
    """The operands of an addition row."""
    a, b = row["prompt"].rstrip("=").split("+")
    return int(a), int(b)
