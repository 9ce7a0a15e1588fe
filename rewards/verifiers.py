"""Built-in verifiers: rewards that check a completion against the data row's reference answer, or take
the score an external verifier reported in the row."""

from __future__ import annotations

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
