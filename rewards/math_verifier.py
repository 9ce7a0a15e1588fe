"""Math answer verifier: scores a completion's final answer against the row's reference `answer`.

Consumes a `Sample` whose row holds `answer`; extracts the completion's final answer
(`\\boxed{...}`, "answer is X", else the last number) and produces 1.0 when it is
mathematically equivalent to the reference (symbolically, via the `math-verify` library).
"""

from __future__ import annotations

import logging
import math
import re
import threading
from typing import Optional

from rlplatform.transport.samples import Sample

_ANSWER_IS = re.compile(r"answer is\s*:?\s*(.+?)\s*\.?\s*$", re.IGNORECASE | re.MULTILINE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


class _BoundByTheWorker(logging.Filter):
    """Drops math-verify's warning that it runs without a timeout of its own: off the main thread it cannot have
    one, and the reward worker bounds the whole call (`rewards[].timeout_s`). Left in, it fills a job's console."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


_BOUND = _BoundByTheWorker()


def math_verify(sample: Sample, *, timeout_s: float = 5.0) -> float:
    """1.0 when the completion's final answer equals the row's `answer` up to mathematical equivalence.

    timeout_s: seconds (rounded up) math-verify may spend parsing or comparing one expression.
        Its timeout uses SIGALRM, which only works on the main thread, so elsewhere it runs
        without one (the reward worker bounds the whole call).
    """
    from math_verify import parse, verify  # here, not at the top: its import costs every job ~1 s of start-up

    for name in ("math_verify.parser", "math_verify.grader"):
        if _BOUND not in logging.getLogger(name).filters:
            logging.getLogger(name).addFilter(_BOUND)

    predicted = extract_answer(sample.completion)
    if predicted is None:
        return 0.0
    timeout = math.ceil(timeout_s) if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"${sample.answer}$", parsing_timeout=timeout)
    target = parse(f"${predicted}$", parsing_timeout=timeout)
    return float(bool(gold and target) and verify(gold, target, timeout_seconds=timeout))


def extract_answer(completion: str) -> Optional[str]:
    """The final answer: the last \\boxed{...}, else the last "answer is X", else the last number."""
    boxed = _last_boxed(completion)
    if boxed is not None:
        return boxed
    stated = _ANSWER_IS.findall(completion)
    if stated:
        return stated[-1].strip("$ ")
    numbers = _NUMBER.findall(completion)
    return numbers[-1] if numbers else None


def _last_boxed(text: str) -> Optional[str]:
    """Contents of the last `\\boxed{...}`, matching nested braces; None if absent or unclosed."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for i in range(begin, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth < 0:
            return text[begin:i]
    return None
