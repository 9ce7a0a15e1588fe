"""The sandbox's judge process: runs the row's tests against the solution's names and decides.

Consumes the tests (stdin) and the solution process's messages (a pipe); produces the verdict,
"passed" or why not, on a report pipe only it holds. The solution's functions and objects are
`Remote` stand-ins: calling one asks the solution process, and what comes back is rebuilt as
exact built-in values, so no code of the solution ever runs here. `==` and `!=` in the tests
compare types too (`wire.strict_equal`).
"""

from __future__ import annotations

import ast
import builtins
import importlib
import linecache
import sys
import traceback
from typing import Any, Dict

from wire import Channel, decode, describe, encode, strict_equal

_EQUAL = "__strict_equal__"  # the name the rewritten tests call for == and !=
# exceptions of the solution that are re-raised as themselves; others arrive as SolutionError
# (StopIteration from a call would silently end the loop that made it; SystemExit would end the judge)
_FORWARDED = {name: kind for name, kind in vars(builtins).items() if isinstance(kind, type)
              and issubclass(kind, Exception) and not issubclass(kind, (StopIteration, StopAsyncIteration))}


class SolutionError(Exception):
    """An exception the solution raised, known by its type's name and its message."""


class SolutionExited(Exception):
    """The solution's process ended while the tests still needed it."""


class Remote:
    """An object living in the solution's process. Calls, attributes, iteration, len, indexing
    and `in` are asked of it there; it equals only itself and has no truth value."""
    __slots__ = ("_link", "_id")

    def __init__(self, link: "Link", number: int) -> None:
        object.__setattr__(self, "_link", link)
        object.__setattr__(self, "_id", number)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._link.call(self, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._link.ask({"op": "getattr", "id": self._id, "name": name})

    def __iter__(self) -> Any:
        return self._link.ask({"op": "iter", "id": self._id})

    def __next__(self) -> Any:
        return self._link.ask({"op": "next", "id": self._id}, stop=True)

    def __len__(self) -> int:
        return self._link.ask({"op": "len", "id": self._id})

    def __getitem__(self, key: Any) -> Any:
        return self._link.ask({"op": "getitem", "id": self._id, "args": [self._link.out(key)]})

    def __contains__(self, item: Any) -> bool:
        return self._link.ask({"op": "contains", "id": self._id, "args": [self._link.out(item)]})

    def __bool__(self) -> bool:
        raise TypeError("the solution returned an object that is not a built-in value; it has no truth value here")

    def __repr__(self) -> str:
        return f"<solution object {self._id}>"


class Link:
    """The judge's end of the channel to the solution process."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def ask(self, request: dict, stop: bool = False) -> Any:
        """Send `request`; the value it produced, or raise what the solution raised."""
        return self.into(self._exchange(request, stop)["value"])

    def call(self, remote: Remote, args: tuple, kwargs: Dict[str, Any]) -> Any:
        """Call `remote`; lists, dicts and sets passed in take the contents the call left them with."""
        reply = self._exchange({"op": "call", "id": remote._id, "args": [self.out(arg) for arg in args],
                                "kwargs": {key: self.out(value) for key, value in kwargs.items()}})
        for arg, after in zip(args, reply.get("args") or []):
            _update(arg, self.into(after))
        return self.into(reply["value"])

    def _exchange(self, request: dict, stop: bool = False) -> dict:
        self.channel.send(request)
        reply = self.channel.receive()
        if reply is None:
            raise SolutionExited("the solution's process ended")
        if "raise" in reply:
            name, message = reply["raise"]
            raise _exception(str(name), str(message), stop)
        return reply

    def into(self, data: Any) -> Any:
        return decode(data, lambda number: Remote(self, number), _stdlib_module)

    def out(self, value: Any) -> Any:
        return encode(value, _handle_of)


def run(tests: str, channel: Channel) -> str:
    """Run `tests` against the solution's names; "passed" or why not."""
    link = Link(channel)
    hello = channel.receive()
    if hello is None or "ready" not in hello:
        return "error: the solution did not load" if hello else "exited: the solution ended before the tests ran"
    namespace = {"__name__": "__main__", _EQUAL: _equal}
    reserved = set(dir(builtins))
    try:
        for name, data in dict(hello["ready"]).items():
            if isinstance(name, str) and not name.startswith("__") and name not in reserved:
                namespace[name] = link.into(data)
        linecache.cache["tests.py"] = (len(tests), None, tests.splitlines(True), "tests.py")  # for tracebacks
        tree = ast.fix_missing_locations(_StrictEquality().visit(ast.parse(tests, "tests.py")))
        exec(compile(tree, "tests.py", "exec"), namespace)
    except BaseException as err:  # the tests may raise anything; so may what the solution sent
        traceback.print_exception(type(err), err, err.__traceback__.tb_next)  # from the tests on
        return describe("exited" if isinstance(err, SolutionExited) else "failed", "tests.py", err)
    return "passed"


class _StrictEquality(ast.NodeTransformer):
    """`a == b` becomes `__strict_equal__(a, b)`, `a != b` its negation."""

    def visit_Compare(self, node: ast.Compare) -> ast.AST:
        self.generic_visit(node)
        if len(node.ops) != 1 or not isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
            return node
        call = ast.Call(ast.Name(_EQUAL, ast.Load()), [node.left, node.comparators[0]], [])
        result = call if isinstance(node.ops[0], ast.Eq) else ast.UnaryOp(ast.Not(), call)
        return ast.copy_location(result, node)


def _equal(a: Any, b: Any) -> bool:
    return strict_equal(a, b, lambda value: isinstance(value, Remote))


def _exception(name: str, message: str, stop: bool) -> BaseException:
    if stop and name == "StopIteration":
        return StopIteration()
    kind = _FORWARDED.get(name)
    try:
        return kind(message) if kind else SolutionError(f"{name}: {message}")
    except TypeError:  # built-ins whose constructor wants more (UnicodeDecodeError, ...)
        return SolutionError(f"{name}: {message}")


def _update(arg: Any, after: Any) -> None:
    """Give a list, dict or set the test passed in the contents the solution left it with."""
    if type(arg) is not type(after):
        return
    if type(arg) is list:
        arg[:] = after
    elif type(arg) in (dict, set):
        arg.clear()
        arg.update(after)


def _handle_of(value: Any) -> int:
    if isinstance(value, Remote):
        return value._id
    raise TypeError(f"cannot pass a {type(value).__name__} to the solution: only built-in values and its own objects")


def _stdlib_module(name: str) -> Any:
    if name not in sys.stdlib_module_names:
        raise ValueError(f"{name} is not a standard library module")
    return importlib.import_module(name)
