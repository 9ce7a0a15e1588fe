"""Safety filters: flag completions that must not be reinforced.

Consume samples and produce 1.0 (flagged) or 0.0 (clean) per sample; whether a flag vetoes,
penalises or drops the sample is the job config's choice. `blocklist` matches words and
patterns; `safety_classifier` thresholds any Hugging Face text classifier's probability.
"""

from __future__ import annotations

import re
from typing import List, Sequence

from rlplatform.rewards.preference import PreferenceModel
from rlplatform.transport.samples import Sample


def blocklist(sample: Sample, *, words: Sequence[str] = (), patterns: Sequence[str] = ()) -> float:
    """1.0 when the completion contains a listed word or matches a listed pattern (case-insensitive).

    words: whole words (or phrases) to block; "ass" does not flag "class".
    patterns: regular expressions to block.
    """
    alternatives = [rf"(?<!\w){re.escape(word)}(?!\w)" for word in words] + list(patterns)
    if not alternatives:
        return 0.0
    blocked = "|".join(f"(?:{alternative})" for alternative in alternatives)
    return float(re.search(blocked, sample.completion, re.IGNORECASE) is not None)


def safety_classifier(samples: List[Sample], *, model_path: str, threshold: float = 0.5, flagged_label: int = 1,
                      device: str = "cpu", batch_size: int = 32, max_length: int = 512) -> List[float]:
    """1.0 for each completion the classifier at `model_path` gives P(flagged_label) >= threshold.

    model_path: a Hugging Face sequence-classification model directory; a single-label model's
        logit is read through a sigmoid, several labels through a softmax.
    threshold: the probability at or above which a completion is flagged.
    flagged_label: index of the label meaning "unsafe" (ignored for a single-label model).
    device, batch_size, max_length: as for `preference_score`; only the completion is classified.
    """
    model = PreferenceModel(model_path, device, batch_size, max_length)
    logits = model.logits([sample.completion for sample in samples])
    flagged = logits[:, 0].sigmoid() if logits.shape[1] == 1 else logits.softmax(-1)[:, flagged_label]
    return [float(p >= threshold) for p in flagged.tolist()]


safety_classifier.batch = True
