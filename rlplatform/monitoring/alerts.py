"""Alert rules over the RL stage's per-step figures: reward collapse, no learner progress,
reward errors, a growing reward-queue backlog, and engine-learner parity (the rollout engine's
log-probs against the learner's on tokens of the same weights: a weight sync that did not fully
load, or numerics that drifted apart).

`AlertRules.check` is pure: it takes one step's figures and returns the alerts that start
firing at that step. A rule fires once and re-arms when its condition clears. The monitor
turns each alert into a console warning, an event-log line and (online) a W&B alert.
"""

from __future__ import annotations

from collections import deque
from dataclasses import KW_ONLY, dataclass
from typing import Deque, Dict, List, Optional

from rlplatform.config import AlertRule

MIN_REWARD_FOR_COLLAPSE = 0.05  # below this the best reward is noise, not a level to fall from


@dataclass
class Alert:
    kind: str
    message: str
    step: int


@dataclass
class StepFigures:
    step: int
    reward_mean: float
    error_fraction: float
    queue_depth: int
    seconds_since_progress: float
    _: KW_ONLY
    parity: Optional[Dict[str, float]] = None  # abs_mean, abs_max, k3, tokens; None: not measured this step
    canary: Optional[Dict[str, float]] = None  # the worst parity canary check since the last step (`parity_canary`)
    scored: int = 0  # samples scored since the step before
    errors: int = 0  # of those, reward errors


class AlertRules:
    def __init__(self, rules: List[AlertRule]) -> None:
        self.rules = rules
        longest = max([r.window for r in rules], default=1)
        self.history: Deque[StepFigures] = deque(maxlen=max(longest, 1))
        self.best_reward = float("-inf")
        self.firing: Dict[str, bool] = {r.kind: False for r in rules}

    def check(self, figures: StepFigures) -> List[Alert]:
        self.history.append(figures)
        alerts = []
        for rule in self.rules:
            message = self._condition(rule, figures)
            if message and not self.firing[rule.kind]:
                alerts.append(Alert(rule.kind, message, figures.step))
            self.firing[rule.kind] = message is not None
        return alerts

    def reward_of_best(self) -> Optional[float]:
        """The reward_collapse rule's window mean as a fraction of the best window mean so far (None before the
        rule has a full window, or without the rule)."""
        rule = next((r for r in self.rules if r.kind == "reward_collapse"), None)
        window = self._window(rule) if rule else []
        if not rule or len(window) < rule.window or self.best_reward <= 0:
            return None
        return sum(f.reward_mean for f in window) / len(window) / self.best_reward

    def check_stall(self, step: int, seconds_since_progress: float) -> List[Alert]:
        """Between learner steps: only the no-progress rules, without touching the history."""
        alerts = []
        for rule in self.rules:
            if rule.kind == "no_progress":
                message = _stall(rule, seconds_since_progress)
                if message and not self.firing[rule.kind]:
                    alerts.append(Alert(rule.kind, message, step))
                self.firing[rule.kind] = message is not None
        return alerts

    def _window(self, rule: AlertRule) -> List[StepFigures]:
        return list(self.history)[-rule.window:]

    def _condition(self, rule: AlertRule, figures: StepFigures) -> Optional[str]:
        window = self._window(rule)
        if rule.kind == "no_progress":
            return _stall(rule, figures.seconds_since_progress)
        if rule.kind == "parity":
            return _parity(rule, figures)
        if len(window) < rule.window:
            return None
        if rule.kind == "reward_collapse":
            return self._reward_collapse(rule, window)
        if rule.kind == "reward_errors":  # the rate over the samples scored in the window, not a mean of steps' rates
            scored, errors = sum(f.scored for f in window), sum(f.errors for f in window)
            rate = errors / scored if scored else 0.0
            return f"reward errors on {errors} of {scored} samples scored over the last {rule.window} steps: rate " \
                   f"{rate:.2f}, limit {rule.threshold:g}" if rate > rule.threshold else None
        growing = window[-1].queue_depth > window[0].queue_depth
        return f"reward queue backlog {window[-1].queue_depth} and growing (limit {rule.threshold:g})" \
            if growing and window[-1].queue_depth > rule.threshold else None

    def _reward_collapse(self, rule: AlertRule, window: List[StepFigures]) -> Optional[str]:
        mean = sum(f.reward_mean for f in window) / len(window)
        self.best_reward = max(self.best_reward, mean)
        if self.best_reward >= MIN_REWARD_FOR_COLLAPSE and mean < rule.threshold * self.best_reward:
            return (f"reward collapsed: mean {mean:.3f} over the last {rule.window} steps is below "
                    f"{rule.threshold:g} x the best {self.best_reward:.3f}")
        return None


def _parity(rule: AlertRule, figures: StepFigures) -> Optional[str]:
    """A step whose engine and learner log-probs differ by more than the threshold on average (|Δ|), on tokens
    the learner scored with the weights that sampled them, or on the parity canary an engine checked."""
    parity, canary = figures.parity, figures.canary
    if parity is not None and parity["abs_mean"] > rule.threshold:
        return (f"engine and learner disagree on tokens of the same weights at step {figures.step}: mean |Δ log-prob| "
                f"{parity['abs_mean']:.4f} (max {parity['abs_max']:.3f}, k3 KL {parity['k3']:.4f}, "
                f"{parity['tokens']:.0f} tokens; limit {rule.threshold:g}): a weight sync that did not load every "
                "tensor, or the engine's numerics")
    if canary is not None and canary["abs_mean"] > rule.threshold:
        return (f"rollout worker {canary['worker']:.0f}'s engine disagrees with the learner on the parity canary "
                f"at version {canary['version']:.0f}: mean |Δ log-prob| {canary['abs_mean']:.4f} (max "
                f"{canary['abs_max']:.3f}, {canary['tokens']:.0f} tokens; limit {rule.threshold:g}): a weight sync "
                "that did not load every tensor, or the engine's numerics")
    return None


def _stall(rule: AlertRule, seconds_since_progress: float) -> Optional[str]:
    minutes = seconds_since_progress / 60
    return f"no learner step for {minutes:.1f} min (limit {rule.threshold:g})" if minutes >= rule.threshold else None
