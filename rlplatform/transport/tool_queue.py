"""The tool queue on Redis Streams: rollout workers submit their episodes' tool calls, tool workers run them.

Requests go to `rlp:<run>:tools:requests` (consumer group `tool-workers`); each names the stream its
result goes back to, one per rollout worker, which only that worker reads. Delivery is the reward
queue's (`StreamQueue`): at least once, results stored once per call id, reclaim of calls a dead
worker held, dead letters. Calls and results travel as msgpack maps with a schema version, checked
field by field on decoding: never pickle.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Union

import msgpack
import redis

from rlplatform.transport.keys import JobKeys, ToolKeys
from rlplatform.transport.stream_queue import StreamQueue
from rlplatform.transport.samples import SCHEMA_VERSION, WireFormatError

GROUP = "tool-workers"
Arguments = Union[str, Dict[str, Any]]  # the text inside `name(...)`, or a JSON tool call's arguments object


@dataclass
class ToolCall:
    call_id: str  # unique within the job: "<episode tag>/t<turn>/c<index>"
    name: str  # the tool asked for
    arguments: Arguments
    reply_to: str = ""  # the result stream of the rollout worker that asked
    created_at: float = 0.0  # unix time the call was submitted


@dataclass
class ToolResult:
    call_id: str
    name: str
    output: str  # what the model is shown
    error: Optional[str] = None  # why the call failed (unknown tool, a raise, a timeout); `output` says it too
    latency_s: float = 0.0  # from submission to the stored result


class ToolQueue(StreamQueue):
    """Both ends of one run's tool queue."""

    def __init__(self, client: redis.Redis, run: str) -> None:
        self.tool_keys = ToolKeys(run)
        super().__init__(client, self.tool_keys.queue, GROUP,
                         JobKeys(run).max_pending)

    def submit(self, calls: List[ToolCall]) -> None:
        self.submit_payloads([encode_call(call) for call in calls])

    def read_results(self, stream: str, count: int = 1024) -> List[ToolResult]:
        """Results on `stream` not read before, without waiting; malformed ones go to dead letters."""
        results = []
        for msg_id, raw in self.read(stream, count, block_ms=None):
            try:
                results.append(decode_result(raw))
            except WireFormatError as err:
                self.client.xadd(self.dead, {"data": raw, "reason": str(err), "message_id": msg_id})
        return results


def encode_call(call: ToolCall) -> bytes:
    return msgpack.packb({"v": SCHEMA_VERSION, "call": asdict(call)})


def encode_result(result: ToolResult) -> bytes:
    return msgpack.packb({"v": SCHEMA_VERSION, "result": asdict(result)})


def decode_call(data: bytes) -> ToolCall:
    fields = _record(data, "call")
    _require(fields, {"call_id": str, "name": str, "reply_to": str, "created_at": (int, float)})
    if not isinstance(fields.get("arguments"), (str, dict)):
        raise WireFormatError("tool call field 'arguments' must be a string or a map")
    return ToolCall(fields["call_id"], fields["name"], fields["arguments"], fields["reply_to"],
                    float(fields["created_at"]))


def decode_result(data: bytes) -> ToolResult:
    fields = _record(data, "result")
    _require(fields, {"call_id": str, "name": str, "output": str, "latency_s": (int, float)})
    if fields.get("error") is not None and not isinstance(fields["error"], str):
        raise WireFormatError("tool result field 'error' must be a string or null")
    return ToolResult(fields["call_id"], fields["name"], fields["output"], fields.get("error"),
                      float(fields["latency_s"]))


def _record(data: bytes, name: str) -> dict:
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as err:  # msgpack raises several unrelated types for garbage input
        raise WireFormatError(f"not a msgpack record: {err}") from None
    if not isinstance(body, dict) or body.get("v") != SCHEMA_VERSION:
        raise WireFormatError(f"not a tool record of schema version {SCHEMA_VERSION}")
    if not isinstance(body.get(name), dict):
        raise WireFormatError(f"record has no '{name}' map")
    return body[name]


def _require(fields: dict, types: dict) -> None:
    for key, kind in types.items():
        value = fields.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise WireFormatError(f"tool record field '{key}' missing or of the wrong type")
