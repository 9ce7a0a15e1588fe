"""Actors that stand in for the job's workers in the supervision tests. Kept apart from the test module: Ray
imports an actor's module in each process it starts (restarts too), and this one imports no torch or
transformers, so a start takes about a second of CPU instead of nine."""

from __future__ import annotations

import os
import time
import uuid

import ray

from rlplatform.actors.evaluator import started_as_restart


@ray.remote(max_restarts=2, max_concurrency=2)  # `pid` answers while `run` runs
class SlowToStart:
    def __init__(self) -> None:
        time.sleep(2)  # every start, restarts too: calls made meanwhile fail at once

    def pid(self) -> int:
        return os.getpid()

    def run(self) -> None:
        time.sleep(600)


@ray.remote(max_restarts=1, max_concurrency=2)
class EndsOnceRestarted:
    """A loop that runs until its process dies; restarted, it sees the stage's stop at once and returns."""

    def pid(self) -> int:
        return os.getpid()

    def run(self) -> None:
        if not started_as_restart():
            time.sleep(600)


class Answering:
    """Answers as `EvaluatorWorker` does, naming its process: ((id, started as a restart), result)."""

    def __init__(self) -> None:
        self.process = (uuid.uuid4().hex, started_as_restart())

    def pid(self) -> int:
        return os.getpid()

    def evaluate_latest(self, *_) -> tuple:
        return self.process, (0, {"accuracy": 0.5})


class SlowToBuild(Answering):
    """An evaluator whose construction (torch, the model, the engine) takes `build_s`."""

    def __init__(self, build_s: float) -> None:
        time.sleep(build_s)
        super().__init__()


AnsweringEvaluator, SlowToBuildEvaluator = (ray.remote(max_restarts=2)(cls) for cls in (Answering, SlowToBuild))
