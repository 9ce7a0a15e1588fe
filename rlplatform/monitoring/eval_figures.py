"""Held-out evaluation figures from completions scored by the job's own rewards.

Consumes the scored completions of the held-out prompts (`samples_per_prompt` per prompt) and
produces the mean total reward, each component's mean, and pass@1 (plus pass@k for k =
`samples_per_prompt`, the unbiased estimator). A completion passes when every role=reward entry
(or only `eval.pass_reward`) scores exactly 1; one whose reward errored does not pass.
`accuracy` is pass@1, the figure the progress line and earlier summaries report.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Dict, List, Optional

from rlplatform.rewards.registry import BoundReward
from rlplatform.transport.samples import ScoredSample


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Chance that at least one of k completions drawn without replacement from n, `correct` of
    which pass, passes: 1 - C(n - c, k) / C(n, k)."""
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def passed(scored: ScoredSample, labels: List[str]) -> bool:
    """Every component of every reward in `labels` (a float reward's one, a dict reward's each) is 1."""
    for label in labels:
        values = [v for name, v in scored.components.items() if name == label or name.startswith(label + "/")]
        if not values or any(v != 1.0 for v in values):
            return False
    return True


def evaluation_figures(scored: List[ScoredSample], samples_per_prompt: int, rewards: List[BoundReward],
                       pass_reward: Optional[str] = None) -> Dict:
    """The evaluation's figures; `scored` holds the completions of each prompt together (group_id)."""
    labels = [pass_reward] if pass_reward else [r.label for r in rewards if r.spec.role == "reward"]
    groups: Dict[str, List[bool]] = defaultdict(list)
    components: Dict[str, List[float]] = defaultdict(list)
    for s in scored:
        groups[s.sample.group_id].append(passed(s, labels))
        for name, value in s.components.items():
            components[name].append(value)
    pass_1 = _mean([pass_at_k(len(g), sum(g), 1) for g in groups.values()])
    figures = {"accuracy": pass_1, "pass_at_1": pass_1, "rows": len(groups), "completions": len(scored),
               "reward_mean": _mean([s.reward for s in scored]),
               "components": {name: _mean(values) for name, values in sorted(components.items())},
               "reward_errors": sum(s.error is not None for s in scored)}
    if samples_per_prompt > 1:
        figures[f"pass_at_{samples_per_prompt}"] = _mean(
            [pass_at_k(len(g), sum(g), samples_per_prompt) for g in groups.values()])
    return figures


def _mean(values: List[float]) -> float:
    return sum(values) / len(values) if values else 0.0
