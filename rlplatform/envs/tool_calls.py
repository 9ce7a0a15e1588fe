"""Reading tool calls out of a model turn, in the two formats models write them.

- tags: `<tool>name(arguments)</tool>`, the arguments being the text inside the parentheses;
- JSON, as chat templates render tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
`parse_tool_calls` returns every call of a turn in order, and for a turn that tries to call a tool
but gets the format wrong, the reason; the environment shows that reason to the model.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import List, Optional

from rlplatform.transport.tool_queue import Arguments

_TAG = re.compile(r"<tool>(.*?)</tool>", re.DOTALL)
_JSON = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_CALL = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_.-]*)\((.*)\)\s*", re.DOTALL)
_OPENERS = ("<tool>", "<tool_call>")


@dataclass
class ParsedCall:
    name: str
    arguments: Arguments


@dataclass
class ParsedTurn:
    calls: List[ParsedCall]
    error: Optional[str] = None  # set when the turn holds a malformed call; `calls` then is empty


def parse_tool_calls(turn: str) -> ParsedTurn:
    """The tool calls in a model turn, or why the turn's attempt at one is malformed."""
    spans = sorted([(m.start(), "tag", m.group(1)) for m in _TAG.finditer(turn)]
                   + [(m.start(), "json", m.group(1)) for m in _JSON.finditer(turn)])
    opened = sum(turn.count(opener) for opener in _OPENERS)
    if opened > len(spans):
        return ParsedTurn([], "malformed tool call: an opening tag without its closing tag")
    calls = []
    for _, kind, body in spans:
        call = _tag_call(body) if kind == "tag" else _json_call(body)
        if isinstance(call, str):
            return ParsedTurn([], call)
        calls.append(call)
    return ParsedTurn(calls)


def _tag_call(body: str):
    match = _CALL.fullmatch(body)
    if match is None:
        return f"malformed tool call {body.strip()[:80]!r}: expected <tool>name(arguments)</tool>"
    return ParsedCall(match.group(1), match.group(2))


def _json_call(body: str):
    try:
        call = json.loads(body)
    except json.JSONDecodeError as err:
        return f"malformed tool call: not JSON ({err.msg} at character {err.pos})"
    arguments = call.get("arguments", {}) if isinstance(call, dict) else None
    if isinstance(arguments, str):  # some templates carry the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not isinstance(arguments, dict):
        return 'malformed tool call: expected {"name": "<tool>", "arguments": {...}}'
    return ParsedCall(call["name"], arguments)
