"""RL steps on samples a test holds: each learner rank gets its share as the job deals it
(`shard_minibatches`, by tokens), and the ranks' metrics are merged as the job merges them. A job's
learner fetches its samples from Redis by id instead (`LearnerGroup.rl_step_async`)."""

from __future__ import annotations

from typing import Dict, List, Optional

import ray

from rlplatform.config import RLConfig
from rlplatform.learners.group import LearnerGroup, merge_rank_metrics, shard, shard_minibatches
from rlplatform.learners.step_result import StepResult
from rlplatform.transport.samples import Sample


def rl_step(learner: LearnerGroup, samples: List[Sample], advantages: List[float], rl: RLConfig,
            sft_rows: Optional[List[Dict]] = None, step: int = 0, max_tokens: Optional[int] = None,
            distill: bool = True) -> StepResult:
    """RL step `step` of `learner` on `samples` (`max_tokens`, `distill`: as `LearnerRank.rl_step`'s)."""
    n = len(learner.ranks)
    weights = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    rows = shard(sft_rows, n) if sft_rows else [None] * n
    refs = [rank.rl_step.remote(s, a, rl, r, step, max_tokens=max_tokens, distill=distill) for rank, s, a, r in
            zip(learner.ranks, shard_minibatches(samples, n, rl.minibatches, weights),
                shard_minibatches(advantages, n, rl.minibatches, weights), rows)]
    return merge_rank_metrics(ray.get(refs))
