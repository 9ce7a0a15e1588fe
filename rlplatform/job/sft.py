"""The SFT stage: supervised steps of the learner group on prompt -> answer rows.

With `sft.stop_at_accuracy` set, the stage measures held-out greedy accuracy every
`sft.eval_every` steps and ends at the first check that reaches it, so RL starts from the same
partial accuracy whatever the machine's speed or floating-point path.
"""

from __future__ import annotations

import math
import random
import time
from functools import partial
from typing import Callable, Dict, List, Optional

from rlplatform.config import SFTConfig
from rlplatform.job.summaries import SFTSummary
from rlplatform.learners.group import LearnerGroup
from rlplatform.learners.step_result import LearnerTotals, StepResult
from rlplatform.monitoring.job_status import NOT_YET, StatusLine
from rlplatform.monitoring.metrics import Metrics
from rlplatform.monitoring.watchdog import watched_call


def run_sft(config: SFTConfig, learner: LearnerGroup, rows: List[Dict], metrics: Metrics, seed: int,
            *, stage: str = "sft", accuracy: Optional[Callable[[], float]] = None,
            watched: Callable[..., StepResult] = partial(watched_call, None, "", list)) -> SFTSummary:
    """Train up to `config.steps` steps on random batches; `accuracy()` measures the learner's current
    weights on held-out rows for the stop rule. Each step is waited on through `watched` (`watched_call` on the
    job's hang rule, its run directory and the learner's ranks): one that takes `monitoring.hang_factor` times the
    longest so far (before one, the learner's set-up) is the learner's hang (`LearnerHung`); by default, the
    learner's own limit. Returns the stage's figures."""
    rng = random.Random(seed)
    metrics.begin(stage)
    learner.start_stage(config.lr)
    start = time.perf_counter()
    result: Optional[StepResult] = None
    checks: List[Dict] = []
    tokens, step, first_step_at, longest_step_s = 0.0, 0, None, 0.0
    totals = LearnerTotals()
    while step < config.steps and not _reached(checks, config.stop_at_accuracy):
        step += 1
        batch = rng.sample(rows, min(config.batch_size, len(rows)))
        fraction, started = lr_fraction(config, step), time.perf_counter()
        result = watched("an SFT step", longest_step_s or learner.set_up_s, checkpoint=None,
                         call=lambda deadline_s: learner.sft_step(batch, fraction, timeout_s=deadline_s))
        longest_step_s = max(longest_step_s, time.perf_counter() - started)
        tokens += result.tokens_total
        totals.add(result)
        first_step_at = first_step_at or time.time()
        if config.stop_at_accuracy and accuracy is not None and step % config.eval_every == 0:
            checks.append({"step": step, "accuracy": accuracy()})
            metrics.log(stage, step, {"eval_accuracy": checks[-1]["accuracy"]})
        if step % config.log_every == 0 or step == config.steps:
            elapsed = time.perf_counter() - start
            metrics.log(stage, step, {**result.metrics(), "rows_per_s": step * config.batch_size / elapsed,
                                      "tokens_per_s": tokens / elapsed})
            metrics.progress(StatusLine(stage, f"{step}/{config.steps}", loss=result.loss,
                                        accuracy=checks[-1]["accuracy"] if checks else NOT_YET,
                                        eta_s=elapsed / step * (config.steps - step)))
    return SFTSummary(steps=step, wall_s=round(time.perf_counter() - start, 2),
                      final_loss=result.loss if result is not None else None, accuracy_checks=tuple(checks),
                      first_step_at=first_step_at, **totals.figures())


def _reached(checks: List[Dict], threshold: float) -> bool:
    return bool(threshold and checks and checks[-1]["accuracy"] >= threshold)


def lr_fraction(config: SFTConfig, step: int) -> float:
    """The fraction of `sft.lr` SFT step `step` (1-based) trains at: a linear rise over `warmup_steps`, then 1, or
    under `cosine` a decay to 10% at `steps`."""
    if step <= config.warmup_steps:
        return step / (config.warmup_steps + 1)
    if config.lr_schedule == "constant":
        return 1.0
    progress = (step - config.warmup_steps) / max(config.steps - config.warmup_steps, 1)
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))
