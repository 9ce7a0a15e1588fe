"""The SFT stage: supervised steps of the learner group on prompt -> answer rows."""

from __future__ import annotations

import random
import time
from typing import Dict, List

from rlplatform.config import SFTConfig
from rlplatform.learners.group import LearnerGroup
from rlplatform.monitoring.metrics import Metrics


def run_sft(config: SFTConfig, learner: LearnerGroup, rows: List[Dict], metrics: Metrics,
            seed: int, stage: str = "sft") -> Dict[str, float]:
    """Train for `config.steps` steps on random batches; returns the stage's figures."""
    rng = random.Random(seed)
    learner.start_stage(config.lr)
    start = time.perf_counter()
    step_metrics: Dict[str, float] = {}
    tokens = 0.0
    for step in range(1, config.steps + 1):
        step_metrics = learner.sft_step(rng.sample(rows, min(config.batch_size, len(rows))))
        tokens += step_metrics["tokens_total"]
        if step % config.log_every == 0 or step == config.steps:
            elapsed = time.perf_counter() - start
            metrics.log(stage, step, {**step_metrics, "rows_per_s": step * config.batch_size / elapsed,
                                      "tokens_per_s": tokens / elapsed})
            metrics.progress({"stage": stage, "step": f"{step}/{config.steps}",
                                  "loss": step_metrics["loss"], "eta_s": elapsed / step * (config.steps - step)})
    return {"steps": config.steps, "wall_s": round(time.perf_counter() - start, 2),
            "final_loss": step_metrics.get("loss")}
