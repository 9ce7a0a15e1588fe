"""The order rollout workers draw prompts in: seeded epochs without replacement.

Every worker shuffles the same epoch order (seeded by the job's seed and the epoch number) and
takes its own share of it, every `shares`-th prompt from position `share`: within an epoch no
prompt is drawn twice, by any worker, and every prompt is drawn once across the workers.
"""

from __future__ import annotations

import random


class EpochSampler:
    def __init__(self, count: int, seed: int, share: int = 0, shares: int = 1) -> None:
        if count < 1:
            raise ValueError("no prompts to draw from: the training rows are empty (or all were skipped)")
        self.count, self.seed, self.share, self.shares = count, seed, share, shares
        self.epoch, self._order, self._next = -1, [], 0

    def draw(self) -> int:
        """The index of the next prompt of this worker's share."""
        if self._next >= len(self._order):
            self._start_epoch()
        self._next += 1
        return self._order[self._next - 1]

    def _start_epoch(self) -> None:
        self.epoch += 1
        order = list(range(self.count))
        random.Random(f"{self.seed}/{self.epoch}").shuffle(order)
        # fewer prompts than workers: each still gets one per epoch (repeats across workers are unavoidable)
        self._order, self._next = order[self.share % self.count::self.shares], 0
