"""When periodic checkpoints land: at the multiples of `checkpoint.every_steps`, although an asynchronous
RL loop starts each learner step as the previous one ends (so a step is nearly always in flight)."""

from __future__ import annotations

from typing import List

from rlplatform.config import load_config
from rlplatform.job.rl_loop import Checkpoints


class Stepping:
    """A policy's RL loop as `Checkpoints` sees it: its version, the step in flight, and the hold flag; a
    finished step starts the next at once unless held (`PolicyRun._finish_step`)."""

    def __init__(self, version: int = 0) -> None:
        self.version, self.hold, self.step_refs = version, False, ["step"]

    def turn(self) -> None:
        if self.step_refs:
            self.version += 1
            self.step_refs = [] if self.hold else ["step"]
        elif not self.hold:
            self.step_refs = ["step"]


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
