"""Built-in verifiers: rewards that check a completion against the data row's reference answer."""

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
