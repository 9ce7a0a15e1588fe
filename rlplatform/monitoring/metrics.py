"""Metrics sinks: the job's W&B run, the live progress line, the job status on Redis and the
event log.

W&B runs online when an API key is configured and offline (files under the run directory,
`wandb sync` later) otherwise. SFT logs `sft/*` against `sft/step`; RL logs one section per
policy, `<policy>/<family>/<name>`, each family against its own axis (`RL_AXES`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Dict, List, Optional

import wandb

from rlplatform.config import JobConfig, to_dict
from rlplatform.monitoring.job_status import JobStatus, StatusLine

# RL metric family -> the step axis it is plotted against
RL_AXES = {"learning": "learner_step", "rewards": "learner_step", "async": "wall_time_s",
           "eval": "samples_seen", "samples": "learner_step", "tools": "learner_step"}


def wandb_mode(mode: str) -> str:
    if mode != "auto":
        return mode
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


class Metrics:
    def __init__(self, config: JobConfig, run_dir: str, run_id: Optional[str] = None,
                 plan: Optional[Dict] = None) -> None:
        """`run_id`: a resumed job's W&B run, continued rather than started anew; `plan`: the job's plan as
        plain data (`JobPlan.described`), W&B's config beside the config as given."""
        self.run: Optional[wandb.Run] = None
        self.online = False
        self.events_path = os.path.join(run_dir, "events.jsonl")
        self.status: Optional[JobStatus] = None  # attached once Redis is up
        self._policies: List[str] = []
        self._stages: List[str] = []
        self.stage, self.step = "start", 0  # where the job is, as the latest figures said: events are dated by it
        mode = wandb_mode(config.wandb.mode)
        self.online = mode == "online"
        if mode != "disabled":
            self.run = wandb.init(project=config.wandb.project, entity=config.wandb.entity, group=config.wandb.group,
                                  name=config.name, dir=run_dir, mode=mode,
                                  config={**to_dict(config), **({"plan": plan} if plan else {})},
                                  id=run_id, resume="allow" if run_id else None,
                                  settings=wandb.Settings(console="off", silent=True))
        self.console = ProgressLine()

    @property
    def wandb_dir(self) -> Optional[str]:
        return os.path.abspath(os.path.dirname(self.run.dir)) if self.run else None

    def begin(self, stage: str) -> None:
        """A stage starts: events until its first figures are dated by it, at step 0."""
        self.stage, self.step = stage, 0

    def log(self, stage: str, step: int, values: Dict[str, float]) -> None:
        """A stage's figures as `<stage>/<name>` against its own `<stage>/step` axis."""
        self.stage, self.step = stage, step
        if not self.run:
            return
        if stage not in self._stages:
            self._stages.append(stage)
            self.run.define_metric(f"{stage}/step")
            self.run.define_metric(f"{stage}/*", step_metric=f"{stage}/step")
        self.run.log({f"{stage}/step": step, **{f"{stage}/{k}": v for k, v in values.items()}})

    def log_rl(self, policy: str, families: Dict[str, Dict[str, object]], axes: Dict[str, float]) -> None:
        """One RL step's figures: `<policy>/<family>/<name>`, plus the policy's axis values."""
        self.stage, self.step = "rl", int(axes["learner_step"])
        if not self.run:
            return
        if policy not in self._policies:
            self._define_policy_axes(policy)
        record = {f"{policy}/{axis}": value for axis, value in axes.items() if axis != "wall_time_s"}
        record["wall_time_s"] = axes["wall_time_s"]
        for family, values in families.items():
            record.update({f"{policy}/{family}/{name}": value for name, value in values.items()})
        self.run.log(record)

    def _define_policy_axes(self, policy: str) -> None:
        self._policies.append(policy)
        self.run.define_metric("wall_time_s")
        for axis in set(RL_AXES.values()) - {"wall_time_s"}:
            self.run.define_metric(f"{policy}/{axis}")
        for family, axis in RL_AXES.items():
            step = "wall_time_s" if axis == "wall_time_s" else f"{policy}/{axis}"
            self.run.define_metric(f"{policy}/{family}/*", step_metric=step)

    def progress(self, line: StatusLine) -> None:
        """The live view: the console line, mirrored to the job status on Redis."""
        self.console.show(line)
        if self.status is not None:
            self.status.write(line)

    def event(self, kind: str, message: str, step: Optional[int] = None) -> None:
        """An alert or notable event: console warning, event log line, W&B alert when online. Without
        `step`, it is dated by the latest figures logged (their stage and step)."""
        step = self.step if step is None else step
        self.console.note(f"WARNING [{kind}] {self.stage} step {step}: {message}")
        with open(self.events_path, "a") as f:
            f.write(json.dumps({"time": time.time(), "kind": kind, "stage": self.stage, "step": step,
                                "message": message}) + "\n")
        if self.run and self.online:
            self.run.alert(title=f"rlplatform: {kind}", text=message, level=wandb.AlertLevel.WARN)

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

    def __init__(self, stream=None) -> None:
        self.stream = stream or sys.stdout
        self.live = self.stream.isatty()
        self._last_len = 0

    def show(self, line: StatusLine) -> None:
        text = "  ".join(f"{k} {v}" for k, v in line.fields().items())
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
