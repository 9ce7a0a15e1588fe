"""The reward error guard: a job whose rewards fail on nearly every sample stops, instead of
generating for nothing.

The RL loop shows it every scored sample as it arrives, every learner step as it ends, and the time
every few seconds. Two windows are watched: the last `monitoring.error_window` learner steps, and the
last `monitoring.error_window_s` seconds (a job whose samples all fail may train no step at all, or
only the few an agent feeds it). When the error fraction of the samples scored over a full window is
above `monitoring.max_error_fraction` (the time window needs at least one batch's samples), the verdict
is a stop, in one line naming the first error of the window: a reward error names its reward. Halfway
through the time window the same condition is an alert first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, List, Optional, Tuple

from rlplatform.config import MonitoringConfig
from rlplatform.transport.samples import ResultMeta

Tally = Tuple[int, int, Optional[str]]  # samples scored, errors among them, the first error


@dataclass
class Verdict:
    kind: str  # "alert" (halfway through the time window) or "stop"
    message: str


class RewardErrorGuard:
    def __init__(self, config: MonitoringConfig, min_samples: int, now: float) -> None:
        """`min_samples`: samples the time window must hold before it can alert or stop (one batch)."""
        self.max_fraction, self.window_s, self.min_samples = config.max_error_fraction, config.error_window_s, min_samples
        self.steps: Deque[Tally] = deque(maxlen=config.error_window)
        self.periods: Deque[Tuple[float, Tally]] = deque()  # (end time, tally) of each period `waiting` closed
        self._step: List = [0, 0, None]  # since the last learner step
        self._period: List = [0, 0, None]  # since the last `waiting`
        self._started = now
        self._alerted = False

    def scored(self, result: ResultMeta) -> None:
        for tally in (self._step, self._period):
            tally[0] += 1
            if result.error is not None:
                tally[1] += 1
                tally[2] = tally[2] or result.error

    def stepped(self) -> Optional[Verdict]:
        """A learner step ended: the samples scored since the previous one fill one slot of the step window."""
        self.steps.append(tuple(self._step))
        self._step = [0, 0, None]
        if len(self.steps) < self.steps.maxlen:
            return None
        return self._verdict("stop", _total(self.steps), f"the last {len(self.steps)} learner steps")

    def waiting(self, now: float) -> Optional[Verdict]:
        """The time window as of `now`: an alert once half of it is over, a stop once all of it is."""
        self.periods.append((now, tuple(self._period)))
        self._period = [0, 0, None]
        while self.periods and self.periods[0][0] <= now - self.window_s:
            self.periods.popleft()
        tally = _total(p[1] for p in self.periods)
        if tally[0] < self.min_samples or tally[1] <= self.max_fraction * tally[0]:
            self._alerted = False
            return None
        covered = now - self._started
        if covered >= self.window_s:
            return self._verdict("stop", tally, f"the last {self.window_s:g} s (monitoring.error_window_s)")
        if covered < self.window_s / 2 or self._alerted:
            return None
        self._alerted = True
        return self._verdict("alert", tally, f"the last {covered:.0f} s; the job stops if this lasts "
                                             f"{self.window_s:g} s (monitoring.error_window_s)")

    def _verdict(self, kind: str, tally: Tally, window: str) -> Optional[Verdict]:
        scored, errors, first = tally
        if scored == 0 or errors <= self.max_fraction * scored:
            return None
        return Verdict(kind, f"reward errors on {errors} of {scored} samples scored over {window}, above "
                             f"monitoring.max_error_fraction {self.max_fraction:g}; first error: {first}")


def _total(tallies) -> Tally:
    tallies = list(tallies)
    return (sum(t[0] for t in tallies), sum(t[1] for t in tallies), next((t[2] for t in tallies if t[2]), None))
