"""The entries of the job's two signal streams on Redis, typed like the queue messages.

- `StepEnd`: a learner rank 0 says its policy ended an RL step (`JobKeys.learner_steps`); the RL loop, waiting
  for results, wakes at once to record it.
- `VersionAnnounced`: the controller says a policy's weights of a version are published (`PolicyKeys.versions`);
  an idle rollout worker wakes at once to load them.

Each is written as its `fields()` and read back with `of`, which refuses an entry that is not one
(`WireFormatError`, naming the field). Neither stream carries data of its own: the step's results and the
version's weights travel elsewhere, so a refused entry loses nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping

from rlplatform.transport.samples import WireFormatError


def _text(fields: Mapping[bytes, bytes], name: str, entry: str) -> str:
    value = fields.get(name.encode())
    if value is None:
        raise WireFormatError(f"{entry} entry without its '{name}' field")
    return value.decode()


def _integer(fields: Mapping[bytes, bytes], name: str, entry: str) -> int:
    text = _text(fields, name, entry)
    try:
        return int(text)
    except ValueError:
        raise WireFormatError(f"{entry} entry's '{name}' is not an integer: {text!r}") from None


@dataclass(frozen=True)
class StepEnd:
    """`policy`'s learner ended RL step `step`."""
    policy: str
    step: int

    def fields(self) -> Dict[str, object]:
        return {"policy": self.policy, "step": self.step}

    @classmethod
    def of(cls, fields: Mapping[bytes, bytes]) -> "StepEnd":
        return cls(_text(fields, "policy", "learner step end"), _integer(fields, "step", "learner step end"))


@dataclass(frozen=True)
class VersionAnnounced:
    """The policy's weights of `version` are published."""
    version: int

    def fields(self) -> Dict[str, object]:
        return {"version": self.version}

    @classmethod
    def of(cls, fields: Mapping[bytes, bytes]) -> "VersionAnnounced":
        return cls(_integer(fields, "version", "version announcement"))
