"""One episode's completion as the learner trains on it: the model's sampled tokens and the observation
tokens between its turns, in one sequence. Built by both kinds of episode, `episodes.MultiTurn`
(environments) and `bridge_episodes.Episode` (agents through the OpenAI bridge). Model tokens carry
their behaviour log-probs and weight versions (mask 1); observation tokens log-prob 0.0, the version
of the model token before them, and mask 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

from rlplatform.actors.completions import Completion


@dataclass
class TokenTrace:
    ids: List[int] = field(default_factory=list)
    logprobs: List[float] = field(default_factory=list)
    versions: List[int] = field(default_factory=list)
    mask: List[int] = field(default_factory=list)

    def add_model_tokens(self, turn: Completion) -> None:
        """Append a model turn's sampled tokens."""
        self.ids += turn.completion_ids
        self.logprobs += turn.logprobs
        self.versions += turn.versions
        self.mask += [1] * len(turn.completion_ids)

    def add_observation(self, ids: List[int]) -> None:
        """Append tokens the model did not write (context only)."""
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += self.versions[-1:] * len(ids)
        self.mask += [0] * len(ids)

    def last_turn(self) -> List[int]:
        """The newest run of model tokens."""
        start = len(self.mask)
        while start > 0 and self.mask[start - 1] == 1:
            start -= 1
        return self.ids[start:]

    @property
    def observation_tokens(self) -> int:
        return len(self.mask) - sum(self.mask)
