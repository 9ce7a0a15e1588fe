"""Text-shape rewards: score a completion's surface form, not its correctness.

Each consumes a `Sample` and produces a float in [0, 1]: whether the completion follows a
required format, contains a pattern, or stays within a length budget. They are usually
combined with a verifier at a small weight.
"""

from __future__ import annotations

import re

from rlplatform.transport.samples import Sample

THINK_ANSWER = r"<think>.*?</think>\s*<answer>.*?</answer>"


def format_match(sample: Sample, *, pattern: str = THINK_ANSWER) -> float:
    """1.0 when the whole completion (surrounding whitespace stripped) matches `pattern`.

    pattern: a regular expression; `.` also matches newlines. The default asks for
        `<think>...</think>` followed by `<answer>...</answer>` and nothing else.
    """
    return float(re.fullmatch(pattern, sample.completion.strip(), re.DOTALL) is not None)


def regex_contains(sample: Sample, *, pattern: str, ignore_case: bool = False) -> float:
    """1.0 when `pattern` (a regular expression) occurs anywhere in the completion.

    ignore_case: match letters regardless of case.
    """
    flags = re.IGNORECASE if ignore_case else 0
    return float(re.search(pattern, sample.completion, flags) is not None)


def length_reward(sample: Sample, *, target_len: int) -> float:
    """1.0 for completions of at most `target_len` tokens, falling linearly to 0.0 at twice that.

    target_len: the token budget (completion tokens, as generated).
    """
    excess = len(sample.completion_ids) - target_len
    return max(0.0, 1.0 - max(excess, 0) / target_len)
