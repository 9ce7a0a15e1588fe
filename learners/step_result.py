"""What a learner step reports to the job, and a stage's totals of it.

`LearnerGroup` merges its ranks' metrics into a frozen `StepResult` (the figures the job reads
by name, the rest by key); the SFT stage and the RL loop each add their steps into one
`LearnerTotals`, which gives the stage's learner throughput and MFU for `summary.json`.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from types import MappingProxyType
from typing import Dict, Mapping

_NAMED = ("loss", "compute_s", "model_tokens_per_s", "mfu", "tokens_total")  # StepResult's own fields


@dataclass(frozen=True)
class StepResult:
    """One learner step's metrics merged over its ranks (`merge_rank_metrics`)."""
    loss: float
    compute_s: float  # the ranks' own step time (their mean)
    model_tokens_per_s: float  # prompt and completion tokens through the model per second, every rank's added up
    mfu: float  # model FLOPs utilisation (the ranks' mean)
    tokens_total: float  # trained tokens of every rank
    _: KW_ONLY
    figures: Mapping[str, float]  # every other metric by name (loss terms, KL, entropy, parity, grad_norm, lr)

    def __post_init__(self) -> None:
        object.__setattr__(self, "figures", MappingProxyType(dict(self.figures)))  # a copy, read-only

    @classmethod
    def of(cls, metrics: Mapping[str, float]) -> "StepResult":
        """The result holding `metrics` by name (`_NAMED` and any others)."""
        return cls(**{name: metrics[name] for name in _NAMED},
                   figures={k: v for k, v in metrics.items() if k not in _NAMED})

    def metrics(self) -> Dict[str, float]:
        """Every metric by name, as W&B logs them."""
        return {**{name: getattr(self, name) for name in _NAMED}, **self.figures}


@dataclass
class LearnerTotals:
    """A stage's learner steps added up, for its time-weighted learner throughput and MFU."""
    compute_s: float = 0.0  # the ranks' own step time (their mean), waits for batches left out
    model_tokens: float = 0.0  # prompt and completion tokens the ranks trained through the model
    mfu_s: float = 0.0  # each step's MFU times its compute seconds

    def add(self, step: StepResult) -> None:
        self.compute_s += step.compute_s
        self.model_tokens += step.model_tokens_per_s * step.compute_s
        self.mfu_s += step.mfu * step.compute_s

    def figures(self) -> Dict[str, float]:
        """`learner_model_tokens_per_s` and `learner_mfu`: tokens per second of compute, and the steps' MFU
        weighted by their compute seconds."""
        seconds = max(self.compute_s, 1e-9)
        return {"learner_model_tokens_per_s": round(self.model_tokens / seconds, 1),
                "learner_mfu": round(self.mfu_s / seconds, 5)}
