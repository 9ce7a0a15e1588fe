"""A reward's score with its reason: what a reward returns when it can say why (the code sandbox's
"passed", "failed", "timeout", ...). Reward workers carry the reason beside the score to the learner
side, where reasons are counted per reward."""

from __future__ import annotations


class Verdict(float):
    """A score that says why it is what it is: a float with a short `reason` ("passed", "timeout", ...)."""

    reason: str

    def __new__(cls, score: float, reason: str) -> "Verdict":
        verdict = super().__new__(cls, score)
        verdict.reason = reason
        return verdict
