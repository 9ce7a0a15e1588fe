"""Example user rewards: one registered with the decorator, one used by import path."""

import rlplatform


@rlplatform.reward("brevity")
def brevity(sample, max_len: int = 4) -> float:
    """1.0 for completions of at most `max_len` characters, falling linearly to 0 at twice that."""
    extra = max(len(sample.completion.strip()) - max_len, 0)
    return max(0.0, 1.0 - extra / max_len)


def no_leading_zero(sample) -> float:
    """1.0 unless the answer is written with a leading zero ("085")."""
    text = sample.completion.strip()
    return 0.0 if len(text) > 1 and text.startswith("0") else 1.0
