"""A job's live progress on Redis: written by the controller, read by `rlp status` anywhere.

The status hash `rlp:<job>:<run id>:status` holds the console's progress line (`StatusLine`: stage, step, ETA,
loss or reward, accuracy, samples/s, queue depth, staleness; a finished job's wall time) and when it was written,
the workers gone silent (while any are) and the OpenAI bridges' URLs (while they serve). `JobStatus.read` gives
it back as one `StatusSnapshot`, refusing a field that is not one (`WireFormatError`, naming the field).
"""

from __future__ import annotations

import time
from dataclasses import KW_ONLY, dataclass, field, fields as dataclass_fields
from typing import Callable, Dict, List, Literal, Mapping, Optional, Tuple, Union

import redis

from rlplatform.transport.bridge_protocol import BRIDGE_STATUS_PREFIX, bridge_status_field
from rlplatform.transport.deadlines import Beat
from rlplatform.transport.keys import JobKeys
from rlplatform.transport.samples import WireFormatError

STATUS_TTL_S = 7 * 24 * 3600  # a finished job's status stays readable for a week
SILENT_WORKERS = "silent_workers"
UPDATED_AT = "updated_at"
NOT_YET = "-"  # a figure of the stage's that it cannot give yet: no step ended, no evaluation run
Figure = Union[float, Literal["-"]]
WIRE_NAMES = {"samples_per_s": "samples/s"}  # as the line has always shown it


@dataclass(frozen=True)
class StatusLine:
    """The progress line; a figure its stage does not have is None and left out of it (SFT has a loss, RL a
    reward, rates and staleness, a finished job's line its wall time alone)."""
    stage: str  # "sft", "rl", "rl <policy>", or how the job ended: "completed", "interrupted", "failed"
    step: Optional[str] = None  # "12/40": the stage's step of its total
    _: KW_ONLY
    eta_s: Optional[Figure] = None
    loss: Optional[float] = None
    reward: Optional[Figure] = None
    accuracy: Optional[Figure] = None  # the latest held-out accuracy
    samples_per_s: Optional[float] = None
    queue: Optional[int] = None  # samples waiting to be scored
    staleness: Optional[Figure] = None  # versions behind, of the step's oldest sample
    wall_s: Optional[float] = None  # the finished job's, to the hundredth

    def fields(self) -> Dict[str, str]:
        """Wire name -> text, in the order the line shows them."""
        return {WIRE_NAMES.get(f.name, f.name): _shown(f.name, getattr(self, f.name))
                for f in dataclass_fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def of(cls, fields: Mapping[str, str]) -> "StatusLine":
        """From a status hash's line fields; an unknown name, a missing stage or a text that is not its field's
        kind is an error."""
        names = {WIRE_NAMES.get(name, name): name for name in _READ}
        unknown = sorted(set(fields) - set(names))
        if unknown:
            raise WireFormatError(f"job status fields not of the progress line: {', '.join(unknown)} "
                                  f"(its fields are {', '.join(names)})")
        if "stage" not in fields:
            raise WireFormatError("job status line without its 'stage' field")
        return cls(**{names[wire]: _READ[names[wire]](wire, text) for wire, text in fields.items()})


@dataclass(frozen=True)
class StatusSnapshot:
    """The status hash as read: its line (None before the first), when that was written, the silent workers'
    listing ("" while none is) and each serving bridge's URL by (policy, rollout worker index)."""
    line: Optional[StatusLine]
    updated_at: Optional[float]
    silent_workers: str = ""
    bridges: Dict[Tuple[str, int], str] = field(default_factory=dict)

    @classmethod
    def of(cls, fields: Mapping[str, str]) -> "StatusSnapshot":
        bridges = {_bridge(name): url for name, url in fields.items() if name.startswith(BRIDGE_STATUS_PREFIX)}
        line = {name: text for name, text in fields.items() if name != UPDATED_AT and not _set_on_its_own(name)}
        updated_at = fields.get(UPDATED_AT)
        return cls(StatusLine.of(line) if line else None,
                   float(_number(UPDATED_AT, updated_at)) if updated_at is not None else None,
                   fields.get(SILENT_WORKERS, ""), bridges)


class JobStatus:
    def __init__(self, client: redis.Redis, run: str) -> None:
        self.client = client
        self.key = JobKeys(run).status

    def write(self, line: StatusLine) -> None:
        """A progress line: its fields replace the previous line's, so a stage's own figures (SFT's loss)
        do not outlive it; the silent workers and the bridges' URLs stay."""
        values = {**line.fields(), UPDATED_AT: f"{time.time():.3f}"}
        stale = [k for k in map(bytes.decode, self.client.hkeys(self.key)) if k not in values and
                 not _set_on_its_own(k)]
        pipe = self.client.pipeline(transaction=False)
        if stale:
            pipe.hdel(self.key, *stale)
        pipe.hset(self.key, mapping=values)
        pipe.expire(self.key, STATUS_TTL_S)
        pipe.execute()

    def show_silent_workers(self, listing: str) -> None:
        """The silent workers' listing, removed when it is empty."""
        if listing:
            self.client.hset(self.key, SILENT_WORKERS, listing)
        else:
            self.client.hdel(self.key, SILENT_WORKERS)

    def read(self) -> Optional[StatusSnapshot]:
        """None where the job has no status (not started, or expired)."""
        fields = {k.decode(errors="replace"): v.decode(errors="replace")
                  for k, v in self.client.hgetall(self.key).items()}
        return StatusSnapshot.of(fields) if fields else None


def _set_on_its_own(name: str) -> bool:
    """Fields not part of a progress line: the silent workers and the bridges' URLs (`announce`)."""
    return name == SILENT_WORKERS or name.startswith(BRIDGE_STATUS_PREFIX)


def _shown(name: str, value: object) -> str:
    """A field's text: a float to 3 decimals below 100 and whole above, as the console has always shown it."""
    if name == "wall_s":  # as the job's summary gives it
        return str(value)
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def _text(name: str, text: str) -> str:
    return text


def _number(name: str, text: str) -> float:
    """An int where the writer gave one, so that it shows again as written (`12`, not `12.000`)."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    raise WireFormatError(f"job status field '{name}' is not a number: {text!r}")


def _count(name: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise WireFormatError(f"job status field '{name}' is not a whole number: {text!r}") from None


def _figure(name: str, text: str) -> Figure:
    return NOT_YET if text == NOT_YET else _number(name, text)


# how each of the line's fields reads back from its text (given its wire name, for the error)
_READ: Dict[str, Callable[[str, str], object]] = {
    "stage": _text, "step": _text, "eta_s": _figure, "loss": _number, "reward": _figure, "accuracy": _figure,
    "samples_per_s": _number, "queue": _count, "staleness": _figure, "wall_s": _number}
assert list(_READ) == [f.name for f in dataclass_fields(StatusLine)]


def _bridge(name: str) -> Tuple[str, int]:
    """(policy, rollout worker index) of a bridge's field, as `bridge_status_field` named it."""
    policy, _, index = name[len(BRIDGE_STATUS_PREFIX):].rpartition("/")
    if not (policy and index.isdigit() and bridge_status_field(policy, int(index)) == name):
        raise WireFormatError(f"job status field '{name}' is not a bridge's URL field "
                              f"({BRIDGE_STATUS_PREFIX}<policy>/<rollout worker index>)")
    return policy, int(index)


def format_beats(beats: List[Beat], now: float) -> List[str]:
    """One line per worker on the job's heartbeat hash: where it runs, what it is doing, its last progress."""
    return [f"{beat.describe()}: last progress {now - beat.at:.0f}s ago (longest between two {beat.longest_round_s:g}s)"
            for beat in sorted(beats, key=lambda beat: beat.worker)]


def format_status(status: StatusSnapshot, now: float) -> str:
    """The one-line view `rlp status` prints: the line, the silent workers, the bridges' URLs and its age."""
    shown = status.line.fields() if status.line is not None else {}
    if status.silent_workers:
        shown[SILENT_WORKERS] = status.silent_workers
    shown.update({bridge_status_field(*bridge): url for bridge, url in sorted(status.bridges.items())})
    age = now - status.updated_at if status.updated_at is not None else 0.0  # a bridge may announce itself first
    return "  ".join(f"{k} {v}" for k, v in shown.items()) + f"  (updated {age:.0f}s ago)"
