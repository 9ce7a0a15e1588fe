"""Built-in verifiers: rewards that check a completion against the data row's reference answer, or take
the score (and each reward function's score) an external verifier reported in the row."""

from __future__ import annotations

from typing import Dict

from rlplatform.transport.samples import Sample


def exact_match(sample: Sample, *, response: str = "completion", answer_key: str = "answer") -> float:
    """1.0 when the completion, stripped of surrounding space, equals the row's `answer`.

    response: the row field compared instead of the completion, e.g. `final_response`, the last
        model turn of a tool episode (a missing field scores 0).
    answer_key: the row field holding the reference answer.
    """
    text = sample.completion if response == "completion" else str(sample.row.get(response, ""))
    return float(text.strip() == str(sample.row.get(answer_key, "")).strip())


def reported_reward(sample: Sample, *, key: str = "verifiers_reward") -> float:
    """The score an environment computed itself and sent in the sample's row: the `verifiers` library's
    rollouts (`rlp verifiers`) carry their reward as `verifiers_reward`.

    key: the row field holding the score; a sample without it is an error, not a zero.
    """
    if key not in sample.row:
        raise KeyError(f"the sample's row has no '{key}' field (rows: {sorted(sample.row)}); this reward scores "
                       "episodes whose agent reports the score, such as those `rlp verifiers` plays")
    return float(sample.row[key])


def reported_components(sample: Sample, *, key: str = "verifiers_rewards") -> Dict[str, float]:
    """Each reward function's score an environment reported in the sample's row (verifiers episodes carry them as
    `verifiers_rewards`; a function that failed, None, reads 0.0), as components `<label>/<function>`. Listed
    with weight 0 beside `verifiers_reward`, they are logged (W&B, evaluations) without adding to the reward.

    key: the row field holding the scores by function name.
    """
    scores = sample.row.get(key)
    if not isinstance(scores, dict) or not scores:
        raise KeyError(f"the sample's row has no '{key}' scores (rows: {sorted(sample.row)}); this reward reads "
                       "the reward functions' scores verifiers episodes report")
    return {name: 0.0 if score is None else float(score) for name, score in scores.items()}
