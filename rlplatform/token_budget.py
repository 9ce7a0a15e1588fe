"""Cutting a batch of sequences into consecutive groups that hold at most a token budget each: the
learner's micro-batches (`learner.micro_batch_tokens`) and the engine's prefill chunks
(`rollout.prefill_tokens`), so that no forward pass holds more than its budget."""

from __future__ import annotations

from typing import List


def micro_batches(lengths: List[int], max_tokens: int, padded: bool = False) -> List[List[int]]:
    """Consecutive indices grouped so that each group holds at most `max_tokens`: the sum of its lengths,
    or with `padded` its size times its longest length (the tokens of a padded batch); a longer single
    item gets a group of its own; `max_tokens` 0 keeps everything in one group."""
    groups: List[List[int]] = []
    load = longest = 0
    for i, length in enumerate(lengths):
        if groups:
            size = (len(groups[-1]) + 1) * max(longest, length) if padded else load + length
        if not groups or (max_tokens and size > max_tokens):
            groups.append([])
            load = longest = 0
        groups[-1].append(i)
        load += length
        longest = max(longest, length)
    return groups
