"""When periodic checkpoints land: at the multiples of `checkpoint.every_steps`, although an asynchronous
RL loop keeps learner steps in flight (one running, the next queued behind it) nearly all the time."""

from __future__ import annotations

from typing import List

from rlplatform.config import load_config
from rlplatform.job.rl_loop import STEPS_IN_FLIGHT, Checkpoints


class Stepping:
    """A policy's RL loop as `Checkpoints` sees it: its version, the steps in flight, and the hold flag. Each
    turn sends one more step while fewer than `STEPS_IN_FLIGHT` are in flight; once that many are, the oldest
    ends and the next is sent at once, unless held (`PolicyRun.advance`)."""

    def __init__(self, version: int = 0) -> None:
        self.version, self.hold, self.steps_in_flight = version, False, 0

    @property
    def step_refs(self) -> List[str]:
        return ["step"] if self.steps_in_flight else []

    def turn(self) -> None:
        if self.steps_in_flight == STEPS_IN_FLIGHT or (self.hold and self.steps_in_flight):
            self.version += 1
            self.steps_in_flight -= 1
        if not self.hold:
            self.steps_in_flight += 1


class Recorded(Checkpoints):
    """The schedule alone: each save records the step it was taken at (the learners and files are other tests')."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.steps: List[int] = []

    def _save(self) -> None:
        self.steps.append(sum(run.version for run in self.runs.values()))
        for name, run in self.runs.items():
            self.saved[name] = run.version
            run.hold = False


def schedule(tmp_path, every: int, start: int, turns: int) -> List[int]:
    job = load_config(overrides=[f"checkpoint.every_steps={every}", f"output_dir={tmp_path}"])
    run = Stepping(start)
    checkpoints = Recorded(job, {"policy": run}, dict, 0)
    for _ in range(turns):
        run.turn()
        checkpoints.maybe_save()
    return checkpoints.steps


def test_checkpoints_land_on_multiples_of_every_steps(tmp_path):
    assert schedule(tmp_path, every=5, start=0, turns=40)[:4] == [5, 10, 15, 20]


def test_after_a_resume_between_multiples_they_land_on_multiples_again(tmp_path):
    assert schedule(tmp_path, every=5, start=7, turns=30)[:3] == [10, 15, 20]
