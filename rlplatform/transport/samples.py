"""Sample records and their wire format: what rollout workers produce and reward workers score.

A `Sample` is one completion with everything the learner needs to train on it off-policy:
token ids, the behaviour log-prob and the policy version of every completion token, and the
data row it answers. A multi-turn episode is one sample too: its completion interleaves the
model's tokens with observation tokens the environment inserted, told apart by `completion_mask`. A
mixture-of-experts policy's sample also carries the experts its tokens were routed to (`routed_experts`), which
the learner replays; a distilling policy's, each token's log-prob under its teacher (`teacher_logprobs`). On Redis they travel as msgpack maps with a schema version; decoding
checks every field, so a malformed message is rejected with a reason and never executed.
A `ResultMeta` is the few fields of a scored sample the controller batches on (ids, version,
reward, token counts), without its tokens or text.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field, fields as dataclass_fields
from typing import Any, Dict, List, Optional, Tuple

import msgpack

SCHEMA_VERSION = 1


class WireFormatError(ValueError):
    """A queue message that is not a valid record of this schema."""


@dataclass
class Sample:
    sample_id: str  # unique: "<group_id>/<index>"
    group_id: str  # the prompt's group; advantages are computed within it
    policy: str  # name of the policy that generated it
    prompt: str
    completion: str
    _: KW_ONLY
    prompt_ids: List[int]
    completion_ids: List[int]
    behaviour_logprobs: List[float]  # log-prob of each completion token under the generating weights
    token_versions: List[int]  # policy version that generated each completion token
    row: Dict[str, Any] = field(default_factory=dict)  # the data row: answer and other fields
    created_at: float = 0.0  # unix time the completion was generated
    completion_mask: List[int] = field(default_factory=list)  # per completion token: 1 the model's own (trained), 0 an observation inserted by the environment; empty: all the model's
    routed_experts: bytes = b""  # a mixture-of-experts policy: the experts each layer routed each token to (`routed_experts` module); empty: none recorded
    teacher_logprobs: List[float] = field(default_factory=list)  # on-policy distillation: each completion token's log-prob under the teacher; empty: not scored
    teacher_version: int = -1  # the teacher's weight version that scored it (-1: none)
    teacher_top_ids: List[List[int]] = field(default_factory=list)  # distill.mode forward_kl: per completion token, the teacher's top_k token ids; empty: none
    teacher_top_logprobs: List[List[float]] = field(default_factory=list)  # their log-probs under the teacher, as the ids
    prompt_position: int = -1  # the prompt ledger's position of its group's prompt (-1: none, an agent's group)

    def __getattr__(self, name: str) -> Any:
        """The data row's fields read as attributes: `sample.answer`, `sample.tests`."""
        row = self.__dict__.get("row") or {}
        if name in row:
            return row[name]
        raise AttributeError(f"sample has no field or row key '{name}'")

    @property
    def version(self) -> int:
        """Version of the oldest model token: what staleness is measured against."""
        versions = [v for v, m in zip(self.token_versions, self.model_token_mask()) if m]
        return min(versions) if versions else 0

    def model_token_mask(self) -> List[int]:
        """`completion_mask`, or all ones when it is empty (every token the model's)."""
        return self.completion_mask or [1] * len(self.completion_ids)

    @property
    def trained_tokens(self) -> int:
        """Completion tokens the model generated (the ones the loss sees)."""
        return sum(self.completion_mask) if self.completion_mask else len(self.completion_ids)


@dataclass
class ScoredSample:
    sample: Sample
    reward: float  # weighted sum of the components
    components: Dict[str, float]  # each reward's own score, by reward name
    error: Optional[str] = None  # set when a reward failed; the learner skips such samples
    filtered: bool = False  # a filter flagged this sample (vetoed, penalised or dropped)
    _: KW_ONLY
    drop: bool = False  # a `drop` filter flagged it: never trained on
    scored_at: float = 0.0  # unix time the reward worker stored the result
    reasons: Dict[str, str] = field(default_factory=dict)  # why, by reward label, for rewards that say (a Verdict)


@dataclass
class ResultMeta:
    """What the controller reads of a scored sample: enough to group, gate, weigh and count it."""
    sample_id: str
    group_id: str
    policy: str
    version: int  # the sample's version (its oldest token's)
    prompt_tokens: int
    _: KW_ONLY
    completion_tokens: int
    reward: float
    components: Dict[str, float]
    error: Optional[str] = None
    filtered: bool = False
    drop: bool = False
    reasons: Dict[str, str] = field(default_factory=dict)  # the scored sample's reasons, by reward label
    teacher_version: int = -1  # on-policy distillation: the teacher's version that scored it (-1: none)
    prompt_position: int = -1  # the prompt ledger's position of its group's prompt (-1: none, an agent's group)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def of(cls, scored: ScoredSample) -> "ResultMeta":
        sample = scored.sample
        return cls(sample.sample_id, sample.group_id, sample.policy, sample.version, len(sample.prompt_ids),
                   completion_tokens=len(sample.completion_ids), reward=float(scored.reward),
                   components=dict(scored.components), error=scored.error, filtered=bool(scored.filtered),
                   drop=bool(scored.drop), reasons=dict(scored.reasons), teacher_version=sample.teacher_version,
                   prompt_position=sample.prompt_position)


_META_TYPES = {"sample_id": str, "group_id": str, "policy": str, "version": int, "prompt_tokens": int,
               "completion_tokens": int, "reward": (int, float), "components": dict, "filtered": bool, "drop": bool}


def encode_meta(meta: ResultMeta) -> bytes:
    return msgpack.packb({"v": SCHEMA_VERSION, **_field_map(meta)})


def decode_meta(data: bytes) -> ResultMeta:
    body = _unpack(data)
    for name, kind in _META_TYPES.items():
        if not isinstance(body.get(name), kind) or (kind is int and isinstance(body[name], bool)):
            raise WireFormatError(f"result record field '{name}' missing or of the wrong type")
    error = body.get("error")
    if error is not None and not isinstance(error, str):
        raise WireFormatError("'error' must be a string or null")
    components = body["components"]
    if not all(isinstance(v, (int, float)) for v in components.values()):
        raise WireFormatError("result record 'components' holds a value that is not a number")
    fields = {name: body[name] for name in _META_TYPES}
    fields.update(reward=float(body["reward"]), components={str(k): float(v) for k, v in components.items()})
    teacher_version, position = body.get("teacher_version", -1), body.get("prompt_position", -1)
    if type(teacher_version) is not int or type(position) is not int:
        raise WireFormatError("result record 'teacher_version' and 'prompt_position' must be integers")
    return ResultMeta(**fields, error=error, reasons=_reasons_from(body.get("reasons", {})),
                      teacher_version=teacher_version, prompt_position=position)


_SAMPLE_TYPES = {
    "sample_id": str, "group_id": str, "policy": str, "prompt": str, "completion": str,
    "prompt_ids": list, "completion_ids": list, "behaviour_logprobs": list,
    "token_versions": list, "row": dict,
}
# what the per-token lists hold (bool, an int subclass, is rejected separately)
_ELEMENT_TYPES = {
    "prompt_ids": (int,), "completion_ids": (int,), "behaviour_logprobs": (int, float), "token_versions": (int,),
}


def encode_sample(sample: Sample) -> bytes:
    return msgpack.packb({"v": SCHEMA_VERSION, "sample": _field_map(sample)})


def decode_sample(data: bytes) -> Sample:
    body = _unpack(data)
    return _sample_from(body.get("sample"))


def encode_scored(scored: ScoredSample) -> bytes:
    return msgpack.packb({
        "v": SCHEMA_VERSION, "sample": _field_map(scored.sample), "reward": float(scored.reward),
        "components": {k: float(v) for k, v in scored.components.items()}, "error": scored.error,
        "filtered": bool(scored.filtered), "drop": bool(scored.drop), "scored_at": float(scored.scored_at),
        "reasons": dict(scored.reasons),
    })


def decode_scored(data: bytes) -> ScoredSample:
    body = _unpack(data)
    reward, components = body.get("reward"), body.get("components")
    if not isinstance(reward, (int, float)) or not isinstance(components, dict):
        raise WireFormatError("scored record needs a numeric 'reward' and a 'components' map")
    error = body.get("error")
    if error is not None and not isinstance(error, str):
        raise WireFormatError("'error' must be a string or null")
    filtered, drop, scored_at = body.get("filtered", False), body.get("drop", False), body.get("scored_at", 0.0)
    if not isinstance(filtered, bool) or not isinstance(drop, bool) or not isinstance(scored_at, (int, float)):
        raise WireFormatError("'filtered' and 'drop' must be booleans and 'scored_at' a number")
    return ScoredSample(_sample_from(body.get("sample")), float(reward),
                        {str(k): float(v) for k, v in components.items()}, error, filtered, drop=drop,
                        scored_at=float(scored_at),
                        reasons=_reasons_from(body.get("reasons", {})))


def _field_map(record: Any) -> Dict[str, Any]:
    """A record's fields by name, its lists and maps as they are (msgpack reads them; `asdict` would deep-copy
    every token list first, a fifth of a reward worker's time with an instant reward)."""
    return {f.name: getattr(record, f.name) for f in dataclass_fields(record)}


def _reasons_from(reasons: Any) -> Dict[str, str]:
    """A scored record's reasons: reward label -> a short reason (they become metric names)."""
    if not isinstance(reasons, dict) or not all(isinstance(k, str) and isinstance(v, str) and 0 < len(v) <= 64
                                                for k, v in reasons.items()):
        raise WireFormatError("'reasons' must map reward labels to reasons of 1 to 64 characters")
    return reasons


def _unpack(data: bytes) -> dict:
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as err:  # msgpack raises several unrelated types for garbage input
        raise WireFormatError(f"not a msgpack record: {err}") from None
    if not isinstance(body, dict):
        raise WireFormatError("record is not a map")
    if body.get("v") != SCHEMA_VERSION:
        raise WireFormatError(f"schema version {body.get('v')!r}, expected {SCHEMA_VERSION}")
    return body


def _sample_from(fields: Any) -> Sample:
    if not isinstance(fields, dict):
        raise WireFormatError("record has no 'sample' map")
    for name, kind in _SAMPLE_TYPES.items():
        if not isinstance(fields.get(name), kind):
            raise WireFormatError(f"sample field '{name}' missing or not a {kind.__name__}")
    for name, kinds in _ELEMENT_TYPES.items():
        if not all(isinstance(x, kinds) and not isinstance(x, bool) for x in fields[name]):
            raise WireFormatError(f"sample field '{name}' holds a value that is not a number")
    lengths = {len(fields[k]) for k in ("completion_ids", "behaviour_logprobs", "token_versions")}
    if len(lengths) != 1:
        raise WireFormatError(f"sample {fields['sample_id']}: per-token fields differ in length")
    created_at = fields.get("created_at", 0.0)
    if not isinstance(created_at, (int, float)) or isinstance(created_at, bool):
        raise WireFormatError("sample field 'created_at' is not a number")
    tokens = lengths.pop()
    mask = _completion_mask(fields, tokens)
    routed = fields.get("routed_experts", b"")
    if not isinstance(routed, bytes):
        raise WireFormatError(f"sample {fields['sample_id']}: 'routed_experts' must be bytes")
    teacher, teacher_version = fields.get("teacher_logprobs", []), fields.get("teacher_version", -1)
    if not isinstance(teacher, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in teacher) \
            or (teacher and len(teacher) != tokens):
        raise WireFormatError(f"sample {fields['sample_id']}: 'teacher_logprobs' must be empty or a number per "
                              f"completion token")
    position = fields.get("prompt_position", -1)
    if type(teacher_version) is not int or type(position) is not int:
        raise WireFormatError(f"sample {fields['sample_id']}: 'teacher_version' and 'prompt_position' must be "
                              f"integers")
    top_ids, top_logprobs = _teacher_top(fields, tokens)
    return Sample(**{name: fields[name] for name in _SAMPLE_TYPES}, created_at=float(created_at), completion_mask=mask,
                  routed_experts=routed, teacher_logprobs=[float(x) for x in teacher], teacher_version=teacher_version,
                  teacher_top_ids=top_ids, teacher_top_logprobs=top_logprobs, prompt_position=position)


def _teacher_top(fields: dict, tokens: int) -> Tuple[List[List[int]], List[List[float]]]:
    """The record's teacher top tokens: both empty, or per completion token the same number of ids and log-probs."""
    ids, logprobs = fields.get("teacher_top_ids", []), fields.get("teacher_top_logprobs", [])
    shaped = isinstance(ids, list) and isinstance(logprobs, list) and len(ids) == len(logprobs) in (0, tokens) and all(
        isinstance(i, list) and isinstance(p, list) and len(i) == len(p) == len(ids[0]) and all(type(x) is int for x in i)
        and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in p) for i, p in zip(ids, logprobs))
    if not shaped:
        raise WireFormatError(f"sample {fields['sample_id']}: 'teacher_top_ids' and 'teacher_top_logprobs' must be "
                              f"empty or, per completion token, as many integer ids as log-probs (the same number "
                              f"at every token)")
    return ids, [[float(x) for x in row] for row in logprobs]


def _completion_mask(fields: dict, tokens: int) -> List[int]:
    """The record's `completion_mask`: empty, or one 0/1 per completion token."""
    mask = fields.get("completion_mask", [])
    if not isinstance(mask, list) or not all(type(m) is int and m in (0, 1) for m in mask):
        raise WireFormatError(f"sample {fields['sample_id']}: 'completion_mask' must be a list of 0 and 1")
    if mask and len(mask) != tokens:
        raise WireFormatError(f"sample {fields['sample_id']}: 'completion_mask' has {len(mask)} entries for "
                              f"{tokens} completion tokens")
    return mask
