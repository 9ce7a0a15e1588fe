"""Built-in verifiers: rewards that check a completion against the data row's reference answer."""

from __future__ import annotations

from rlplatform.transport.samples import Sample


def exact_match(sample: Sample) -> float:
    """1.0 when the completion, stripped of surrounding space, equals the row's `answer`."""
    return float(sample.completion.strip() == str(sample.row.get("answer", "")).strip())
