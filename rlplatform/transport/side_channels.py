"""The entries of the job's two signal streams on Redis, typed like the queue messages.

- `StepEnd`: a learner rank 0 says its policy ended an RL step (`JobKeys.learner_steps`); the RL loop, waiting
  for results, wakes at once to record it.
- `VersionAnnounced`: the controller says a policy's weights of a version are published (`PolicyKeys.versions`);
  an idle rollout worker wakes at once to load them.
- `AttachRequest`: `rlp rollout-worker` asks the job for rollout workers on a node (`JobKeys.attach_requests`),
  and `AttachAnswer` is the job's reply (`JobKeys.attach_answer`): the workers it started, or why none.

Each is written as its `fields()` and read back with `of`, which refuses an entry that is not one
(`WireFormatError`, naming the field). No entry carries data of its own: the step's results and the
version's weights travel elsewhere, and a refused attach request is answered with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Mapping, Tuple

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


@dataclass(frozen=True)
class AttachRequest:
    """`workers` rollout workers of policy `policy` (empty: the job's only one) on the Ray node `node_id`, or,
    without one, on the node at `node_ip`; `request` names the request's lease and answer."""
    request: str
    policy: str
    node_id: str
    node_ip: str
    workers: int

    def fields(self) -> Dict[str, object]:
        return {"request": self.request, "policy": self.policy, "node_id": self.node_id, "node_ip": self.node_ip,
                "workers": self.workers}

    @classmethod
    def of(cls, fields: Mapping[bytes, bytes]) -> "AttachRequest":
        entry = "attach request"
        return cls(_text(fields, "request", entry), _text(fields, "policy", entry), _text(fields, "node_id", entry),
                   _text(fields, "node_ip", entry), _integer(fields, "workers", entry))


@dataclass(frozen=True)
class AttachAnswer:
    """The job's answer to an attach request: the names of the rollout workers it started, or, with none, why."""
    workers: Tuple[str, ...]
    refused: str = ""

    def fields(self) -> Dict[str, object]:
        return {"workers": ",".join(self.workers), "refused": self.refused}

    @classmethod
    def of(cls, fields: Mapping[bytes, bytes]) -> "AttachAnswer":
        names = _text(fields, "workers", "attach answer")
        return cls(tuple(name for name in names.split(",") if name), _text(fields, "refused", "attach answer"))
