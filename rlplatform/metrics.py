"""Metrics sinks: the job's W&B run and the live progress line on the console.

W&B runs online when an API key is configured and offline (files under the run directory,
`wandb sync` later) otherwise. Each stage logs under its own prefix against its own step
axis (`sft/step`, `rl/step`).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Dict, Optional

import wandb

from rlplatform.config import JobConfig, to_dict


def wandb_mode(mode: str) -> str:
    if mode != "auto":
        return mode
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class Metrics:
    def __init__(self, config: JobConfig, run_dir: str) -> None:
        self.run: Optional[wandb.Run] = None
        mode = wandb_mode(config.wandb.mode)
        if mode != "disabled":
            self.run = wandb.init(project=config.wandb.project, entity=config.wandb.entity,
                                  name=config.name, dir=run_dir, mode=mode, config=to_dict(config),
                                  settings=wandb.Settings(console="off", silent=True))
            for stage in ("sft", "rl", "eval"):
                self.run.define_metric(f"{stage}/step")
                self.run.define_metric(f"{stage}/*", step_metric=f"{stage}/step")
        self.console = ProgressLine()

    @property
    def wandb_dir(self) -> Optional[str]:
        return os.path.abspath(os.path.dirname(self.run.dir)) if self.run else None

    def log(self, stage: str, step: int, values: Dict[str, float]) -> None:
        if self.run:
            self.run.log({f"{stage}/step": step, **{f"{stage}/{k}": v for k, v in values.items()}})

    def summary(self, values: Dict[str, float]) -> None:
        if self.run:
            self.run.summary.update(values)

    def finish(self, failed: bool = False) -> None:
        self.console.done()
        if self.run:
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None


class ProgressLine:
    """One status line, redrawn in place on a terminal and printed as plain lines otherwise."""

    def __init__(self, stream=sys.stdout) -> None:
        self.stream = stream
        self.live = stream.isatty()
        self._last_len = 0

    def show(self, fields: Dict[str, object]) -> None:
        text = "  ".join(f"{k} {_fmt(v)}" for k, v in fields.items())
        if self.live:
            self.stream.write("\r" + text.ljust(self._last_len))
            self._last_len = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        self.done()
        self.stream.write(text + "\n")
        self.stream.flush()

    def done(self) -> None:
        if self.live and self._last_len:
            self.stream.write("\n")
            self._last_len = 0


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


class Rate:
    """Events per second since creation."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.count = 0

    def add(self, n: int) -> None:
        self.count += n

    def per_s(self) -> float:
        return self.count / max(time.perf_counter() - self.start, 1e-9)
