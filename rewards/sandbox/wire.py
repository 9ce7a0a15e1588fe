"""What crosses between the sandbox's solution process, its judge and the caller: messages, values
and one-line reasons, and how the judge compares values.

`encode` turns a value into JSON with type tags: only exact built-in types (no subclasses) travel
as values; anything else stays in the solution's process and travels as a handle number. `decode`
rebuilds exact built-ins (the judge's `Remote` stands in for handles). `strict_equal` is the
judge's `==`: equal values of the same type (int and float compare by value; bool is not a number).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any, Callable, Optional

_SCALARS = (type(None), bool, int, float, str)
_CONTAINERS = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset"}
_BY_TAG = {tag: kind for kind, tag in _CONTAINERS.items()}
PLAIN = frozenset(_SCALARS) | frozenset(_CONTAINERS) | {dict, bytes, complex}
_NUMBERS = (int, float)


def encode(value: Any, handle: Callable[[Any], int]) -> Any:
    """`value` as JSON-ready data; `handle(obj)` numbers an object that cannot travel as a value."""
    kind = type(value)
    if kind is int and value.bit_length() > 64:  # in hex: decimal strings of huge ints are length-limited
        return {"int": hex(value)}
    if kind in _SCALARS:
        return value
    if kind in _CONTAINERS:
        return {_CONTAINERS[kind]: [encode(item, handle) for item in value]}
    if kind is dict:
        return {"dict": [[encode(k, handle), encode(v, handle)] for k, v in value.items()]}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is complex:
        return {"complex": [value.real, value.imag]}
    if kind is type(sys) and value.__name__ in sys.stdlib_module_names:
        return {"module": value.__name__}
    return {"handle": handle(value)}


def decode(data: Any, remote: Callable[[int], Any], module: Callable[[str], Any]) -> Any:
    """The value `encode` wrote; `remote(n)` stands for handle n, `module(name)` for a stdlib module."""
    if not isinstance(data, dict):
        return data
    (tag, body), = data.items()
    if tag in _BY_TAG:
        return _BY_TAG[tag](decode(item, remote, module) for item in body)
    if tag == "dict":
        return {decode(k, remote, module): decode(v, remote, module) for k, v in body}
    if tag == "int":
        return int(body, 16)
    if tag == "bytes":
        return bytes.fromhex(body)
    if tag == "complex":
        return complex(*body)
    if tag == "module":
        return module(body)
    if tag == "handle":
        return remote(int(body))
    raise ValueError(f"unknown value tag {tag!r}")


def strict_equal(a: Any, b: Any, is_remote: Callable[[Any], bool]) -> bool:
    """`a == b` with types: built-in values must have the same type all the way down (int and
    float compare by value, bool never equals a number); a remote object equals only itself;
    objects the tests built themselves keep their own `==`."""
    kind_a, kind_b = type(a), type(b)
    if kind_a in _NUMBERS and kind_b in _NUMBERS:
        return a == b
    if is_remote(a) or is_remote(b):
        return a is b
    if kind_a not in PLAIN or kind_b not in PLAIN:
        return bool(a == b)
    if kind_a is not kind_b:
        return False
    if kind_a in (list, tuple):
        return len(a) == len(b) and all(strict_equal(x, y, is_remote) for x, y in zip(a, b))
    if kind_a is dict:
        return a.keys() == b.keys() and all(strict_equal(a[k], b[k], is_remote) for k in a)
    if kind_a in (set, frozenset):
        return _typed(a) == _typed(b)
    return a == b


def _typed(items: Any) -> set:
    """A set's items marked so that True and 1 stay apart."""
    return {(type(item) is bool, item) for item in items}


class Channel:
    """Newline-delimited JSON messages over two pipe ends."""

    def __init__(self, fd_in: int, fd_out: int) -> None:
        self._in, self._out = os.fdopen(fd_in, "rb"), os.fdopen(fd_out, "wb")

    def send(self, message: dict) -> None:
        self._out.write(json.dumps(message).encode() + b"\n")
        self._out.flush()

    def receive(self) -> Optional[dict]:
        """The next message, or None once the other side has closed its end."""
        line = self._in.readline()
        return json.loads(line) if line else None


def describe(kind: str, filename: str, err: BaseException) -> str:
    """One line naming the exception and the line of `filename` it came from."""
    if isinstance(err, MemoryError):
        return f"memory: MemoryError in {filename}"
    lines = [frame.lineno for frame in traceback.extract_tb(err.__traceback__) if frame.filename == filename]
    where = f" line {lines[-1]}" if lines else ""
    detail = f": {err}" if str(err) else ""
    return f"{kind}: {type(err).__name__} in {filename}{where}{detail}"[:300].replace("\n", " ")
