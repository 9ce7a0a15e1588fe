"""What each stage reports to the job, a policy's results, and the job's summary.json.

`run_sft` returns a frozen `SFTSummary` and `run_rl` a frozen `RLSummary` per policy; the controller
keeps them in each policy's `PolicyResults` with its data counts and evaluations, and the job's status,
start-up times and policies' results in its `JobSummary`. `to_json` gives the figures summary.json and
W&B show; `state` what a checkpoint keeps, read back by `from_state`.
"""

from __future__ import annotations

import re
import time
from dataclasses import KW_ONLY, dataclass, field, fields
from types import MappingProxyType
from typing import Any, Dict, Mapping, Optional, Tuple


@dataclass(frozen=True)
class SFTSummary:
    """The SFT stage's figures (`run_sft`)."""
    steps: int
    wall_s: float
    final_loss: Optional[float]  # the last step's loss (None without a step)
    accuracy_checks: Tuple[Mapping[str, float], ...]  # {"step", "accuracy"} of each `sft.stop_at_accuracy` check
    first_step_at: Optional[float]  # wall-clock time the first step ended (summary.json turns it into startup_s)
    _: KW_ONLY
    learner_model_tokens_per_s: float  # `LearnerTotals.figures`
    learner_mfu: float

    def to_json(self) -> Dict[str, Any]:
        """The figures summary.json shows under `stages/sft` (the first step's clock reading left out)."""
        return {key: value for key, value in self.state().items() if key != "first_step_at"}

    def state(self) -> Dict[str, Any]:
        """Every field as JSON values, as a checkpoint's state.json keeps them."""
        return {"steps": self.steps, "wall_s": self.wall_s, "final_loss": self.final_loss,
                "accuracy_checks": [dict(check) for check in self.accuracy_checks],
                "first_step_at": self.first_step_at,
                "learner_model_tokens_per_s": self.learner_model_tokens_per_s, "learner_mfu": self.learner_mfu}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> "SFTSummary":
        return cls(**{**state, "accuracy_checks": tuple(state["accuracy_checks"])})


SAMPLE_OUTCOMES = ("trained", "dropped_stale", "dropped_error", "dropped_zero_advantage", "dropped_expired",
                   "dropped_invalid", "abandoned_at_resume", "unused_at_end")  # each generated sample ends in one


def samples_unaccounted(rl: Mapping[str, Any]) -> int:
    """Samples a summary's `rl` counts as generated but in none of `SAMPLE_OUTCOMES` (`samples_<outcome>`): 0
    when every sample is accounted for."""
    return rl["samples_generated"] - sum(rl[f"samples_{outcome}"] for outcome in SAMPLE_OUTCOMES)


@dataclass(frozen=True)
class RLFigures:
    """A policy's RL sample counts over every attempt (samples_generated = trained + dropped + abandoned + unused)
    and this attempt's rates (`rl_loop.stage_figures`), as summary.json shows them under `rl`."""
    samples_generated: int
    tokens_generated: int
    samples_scored: int
    samples_trained: int
    samples_dropped_stale: int
    _: KW_ONLY
    samples_dropped_error: int
    samples_dropped_zero_advantage: int
    signal_group_fraction: float  # of the groups in batches, those whose rewards differ
    samples_dropped_expired: int
    groups_expired: int
    group_deadline_s: float  # the deadline groups expired at, as it stood at the end (`GroupDeadline`)
    agent_episodes_expired: int  # agents' episodes the OpenAI bridges dropped, their agents silent too long
    samples_dropped_invalid: int
    samples_abandoned_at_resume: int
    samples_unused_at_end: int
    samples_unused_where: Mapping[str, int]  # where the unused ones were left
    reward_errors: int
    reward_reasons: Mapping[str, int]  # `<reward>/<reason>` -> samples
    policy_versions: int
    max_staleness_trained: int
    staleness_histogram: Mapping[str, int]  # versions behind -> samples trained
    samples_per_s: float  # generated, this attempt
    trained_per_s: float  # this attempt
    learner_busy_fraction: float
    learner_steps_queued: int
    learner_model_tokens_per_s: float  # `LearnerTotals.figures`
    learner_mfu: float
    rollout_busy_fraction: float
    weight_publish_s: float
    weight_syncs: int
    weight_sync_s: float
    weight_bytes_per_sync: int
    # a policy whose rollout workers come and go (`rollout.max_workers`): `ElasticRollout.figures`; else None
    rollout_workers_joined: Optional[int] = None
    rollout_workers_left: Optional[int] = None
    rollout_groups_reissued: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("samples_unused_where", "reward_reasons", "staleness_histogram"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))  # a copy, read-only

    def to_json(self) -> Dict[str, Any]:
        """Every figure in field order (the elastic ones only where the workers come and go)."""
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: dict(value) if isinstance(value, Mapping) else value for name, value in shown.items()
                if value is not None or name not in _ELASTIC}


_ELASTIC = ("rollout_workers_joined", "rollout_workers_left", "rollout_groups_reissued")


@dataclass(frozen=True)
class RLSummary:
    """A policy's RL stage figures (`run_rl`), written once every worker has stopped."""
    steps: int  # the policy version reached
    wall_s: float  # this attempt's
    figures: RLFigures  # the counts over every attempt and this attempt's rates
    time_breakdown: Mapping[str, float]  # seconds of generation, queue submits, reward work, learner steps, weights
    eval_history: Tuple[Mapping[str, float], ...]  # held-out accuracy by version (`RLMonitor.evaluation`)
    _: KW_ONLY
    parity: Mapping[str, Any]  # `RLMonitor.parity_totals`
    rewards: Mapping[str, Any]  # `RLMonitor.reward_totals`
    ledger: Mapping[str, int]  # the prompt ledger's counts
    first_step_at: Optional[float]  # wall-clock time the first learner step ended
    ended_by: str  # "max_steps", "idle_timeout" or "stop"
    tools: Optional[Mapping[str, float]]  # `RLMonitor.tool_totals` of a multi-turn job, else None
    restarts: Mapping[str, int]  # worker restarts by kind: rollout, reward, evaluator
    checkpoint: Optional[str]  # the newest checkpoint
    results_held_at_end: int  # results stored and neither trained nor dropped, all policies'
    controller_cpu_s: float  # the controller's CPU time in the stage, all policies'
    wandb_dir: Optional[str]
    distill: Mapping[str, Any] = field(default_factory=dict)  # `RLMonitor.distill_totals` (empty: the policy does not distil)

    def __post_init__(self) -> None:
        object.__setattr__(self, "eval_history", tuple(self.eval_history))

    def to_json(self) -> Dict[str, Any]:
        """The figures summary.json shows under `rl` (the first step's clock reading left out)."""
        extras = {"tools": dict(self.tools)} if self.tools is not None else {}
        extras.update({"distill": dict(self.distill)} if self.distill else {})
        return {"steps": self.steps, "wall_s": self.wall_s, **self.figures.to_json(),
                "time_breakdown": dict(self.time_breakdown), "eval_history": [dict(h) for h in self.eval_history],
                "parity": dict(self.parity), "rewards": dict(self.rewards), "ledger": dict(self.ledger),
                "ended_by": self.ended_by, **extras, "restarts": dict(self.restarts), "checkpoint": self.checkpoint,
                "results_held_at_end": self.results_held_at_end, "controller_cpu_s": self.controller_cpu_s,
                "wandb_dir": self.wandb_dir}


_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")  # terminal escape sequences (colours) in library messages


def plain_text(text: str) -> str:
    """`text` without terminal escape sequences: error messages as summary.json keeps them."""
    return _ANSI.sub("", text)


# evaluation labels in the order a job records them: the version-0 weights after SFT, or as they started when
# SFT is off, then the weights after RL
EVAL_LABELS = ("after_sft", "before_rl", "after_rl")


def first_eval_label(sft_enabled: bool) -> str:
    """The label of version 0's evaluation: "after_sft", or "before_rl" for a job without SFT."""
    return "after_sft" if sft_enabled else "before_rl"


@dataclass
class PolicyResults:
    """A policy's results as the controller gathers them: its data counts, each stage's summary as the stage
    returns it, and its evaluations by label (`EVAL_LABELS`)."""
    data: Dict[str, int]
    sft: Optional[SFTSummary] = None
    rl: Optional[RLSummary] = None
    eval: Dict[str, Dict] = field(default_factory=dict)

    def record_eval(self, label: str, figures: Dict) -> None:
        """An evaluation's figures under `label`; the background evaluation of version 0 records from its
        own thread when it ends."""
        self.eval[label] = figures

    def to_json(self) -> Dict[str, Any]:
        """The policy's part of summary.json: `stages` holds each stage's steps and wall time (SFT's every
        figure), `rl` the RL stage's figures."""
        stages: Dict[str, Any] = {}
        if self.sft is not None:
            stages["sft"] = self.sft.to_json()
        if self.rl is not None:
            stages["rl"] = {"steps": self.rl.steps, "wall_s": self.rl.wall_s}
        rl = {"rl": self.rl.to_json()} if self.rl is not None else {}
        return {"data": self.data, "stages": stages, "eval": self.eval, **rl}

    def state(self) -> Dict[str, Any]:
        """What a checkpoint keeps (taken during RL, before its summary exists): data, SFT summary, evaluations."""
        return {"data": self.data, "stages": {"sft": self.sft.state()} if self.sft is not None else {},
                "eval": self.eval}

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> "PolicyResults":
        sft = state["stages"].get("sft")
        return cls(state["data"], SFTSummary.from_state(sft) if sft is not None else None, eval=state["eval"])


@dataclass
class StartupTimes:
    """Seconds from the job's start (`started_at`, wall clock) to each start-up milestone it reached, in order."""
    started_at: float
    seconds: Dict[str, Optional[float]] = field(default_factory=dict)

    def mark(self, milestone: str, at: Optional[float] = None) -> None:
        """`milestone` reached at `at` (wall clock, default now)."""
        self.seconds[milestone] = round((time.time() if at is None else at) - self.started_at, 2)

    def mark_first_steps(self, results: Mapping[str, PolicyResults]) -> None:
        """The first SFT and the first RL learner step of any policy, from each stage summary's `first_step_at`
        clock reading (None for a stage that took no step)."""
        for stage in ("sft", "rl"):
            times = [s.first_step_at for s in (getattr(r, stage) for r in results.values())
                     if s is not None and s.first_step_at is not None]
            self.seconds[f"to_first_{stage}_step_s"] = round(min(times) - self.started_at, 2) if times else None


@dataclass
class JobSummary:
    """The job's summary.json: its status, start-up times and every policy's results. A one-policy job's
    figures sit at the top level; a job with `policies` also lists each under `policies`."""
    name: str
    run_dir: str
    run_id: str
    startup: StartupTimes
    several_policies: bool
    _: KW_ONLY
    status: str = "running"  # then completed, interrupted or failed
    results: Dict[str, PolicyResults] = field(default_factory=dict)  # set when the stages end
    wandb_dir: Optional[str] = None
    error: Optional[str] = None
    wall_s: Optional[float] = None
    exit_code: Optional[int] = None  # a signal's, or the failure's own (1; 3: a learner hung)

    def to_json(self) -> Dict[str, Any]:
        shown: Dict[str, Any] = {"status": self.status, "name": self.name, "run_dir": self.run_dir,
                                 "startup_s": dict(self.startup.seconds), "run_id": self.run_id,
                                 "wandb_dir": self.wandb_dir}
        if self.results:
            shown.update(next(iter(self.results.values())).to_json())
            if self.several_policies:
                shown["policies"] = {name: r.to_json() for name, r in self.results.items()}
        optional = {"error": self.error, "wall_s": self.wall_s, "exit_code": self.exit_code}
        shown.update({key: value for key, value in optional.items() if value is not None})
        return shown
