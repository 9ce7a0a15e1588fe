"""The tool demo's data: "123*4=" rows whose SFT target is a calculator trace, generated from a seed.

Each row holds the `prompt`, the `product` the rewards check, and as `answer` the trace a demo
model learns the tool format from: a tag call ending its turn (EOS), the observation the tool
environment shows, then the product. Its tokens are exactly those of such an episode.
"""

from __future__ import annotations

import random
from typing import Dict, List

Row = Dict[str, str]


def tool_calc_rows(count: int, rng: random.Random, eos: str = "</s>") -> List[Row]:
    """`count` rows multiplying a 3-digit number by a 1-digit one (2-9)."""
    rows = []
    for _ in range(count):
        a, b = rng.randint(100, 999), rng.randint(2, 9)
        product = str(a * b)
        trace = f"<tool>calculator({a}*{b})</tool>{eos}<result>{product}</result>{product}"
        rows.append({"prompt": f"{a}*{b}=", "answer": trace, "product": product})
    return rows
