"""The sandbox's solution process: runs the completion's code, then answers the judge's calls.

Consumes the code (stdin) and the judge's requests (a pipe); produces replies with the raw values
the code returned, as `wire` values, and, on its report pipe, the audit hook's violations.
Nothing here decides a verdict: the code runs in this process and may rewrite any of it.
"""

from __future__ import annotations

import importlib
import linecache
import operator
import os
import sys
import traceback
from typing import Any, Callable, Dict, Optional

from wire import Channel, decode, describe, encode

# audit events denied outright, by prefix, and the reason's kind ("socket.__new__" is allowed:
# creating a socket is harmless, connecting or resolving is not)
_DENIED_EVENTS = {
    "socket.": "network", "os.fork": "process", "os.posix_spawn": "process", "os.spawn": "process",
    "os.exec": "process", "os.system": "process", "subprocess.Popen": "process", "pty.spawn": "process",
    "os.kill": "process", "signal.pthread_kill": "process", "ctypes.": "native",
}
_DENIED_PREFIXES = tuple(_DENIED_EVENTS)
# audit events whose path arguments must lie inside the scratch directory
_PATH_EVENTS = {
    "os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.link", "os.symlink",
    "os.truncate", "os.utime", "os.mkfifo", "os.mknod", "os.setxattr", "os.removexattr",
}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
_SPECIAL = {"iter": iter, "next": next, "len": len, "getitem": operator.getitem, "contains": operator.contains}


class SandboxViolation(PermissionError):
    """Raised inside the sandbox by the audit hook."""


def run(code: str, channel: Channel, report: Callable[[str], None]) -> None:
    """Run `code`, tell the judge its top-level names (or why it failed), then serve the judge."""
    hook = _audit_hook(os.path.realpath(os.getcwd()), report)
    namespace: Dict[str, Any] = {"__name__": "__main__"}
    linecache.cache["solution.py"] = (len(code), None, code.splitlines(True), "solution.py")  # for tracebacks
    run_code, build, objects = exec, compile, {}  # bound before the code can replace the builtins
    sys.addaudithook(hook)
    try:
        run_code(build(code, "solution.py", "exec"), namespace)
    except BaseException as err:  # untrusted code may raise anything, SystemExit included
        traceback.print_exception(type(err), err, err.__traceback__.tb_next)  # from the untrusted frame on
        reason = describe("error", "solution.py", err)
        report(f"error {reason}")
        channel.send({"error": reason})
        return
    names = {name: _encode(value, objects) for name, value in namespace.items() if not name.startswith("__")}
    channel.send({"ready": names})
    while (request := channel.receive()) is not None:
        channel.send(_answer(request, objects))


def _answer(request: dict, objects: Dict[int, Any]) -> dict:
    """Carry out one request of the judge on a handle; the value, or the exception it raised."""
    target = objects[request["id"]]
    args = [_decode(arg, objects) for arg in request.get("args", [])]
    try:
        if request["op"] == "call":
            kwargs = {key: _decode(value, objects) for key, value in request["kwargs"].items()}
            value = target(*args, **kwargs)
            changed = [_encode(arg, objects) if type(arg) in (list, dict, set) else None for arg in args]
            return {"value": _encode(value, objects), "args": changed}
        if request["op"] == "getattr":
            return {"value": _encode(getattr(target, request["name"]), objects)}
        return {"value": _encode(_SPECIAL[request["op"]](target, *args), objects)}
    except BaseException as err:  # raised by the untrusted code; the judge decides what it means
        return {"raise": [type(err).__name__, _text(err)]}


def _encode(value: Any, objects: Dict[int, Any]) -> Any:
    """`value` as wire data; values that cannot be written out (too deep, too long) travel as handles."""
    def handle(obj: Any) -> int:
        objects[id(obj)] = obj
        return id(obj)
    try:
        return encode(value, handle)
    except (RecursionError, ValueError):
        return {"handle": handle(value)}


def _decode(data: Any, objects: Dict[int, Any]) -> Any:
    return decode(data, objects.__getitem__, importlib.import_module)


def _text(err: BaseException) -> str:
    try:
        return str(err)[:300]
    except BaseException:  # a hostile __str__
        return ""


def _audit_hook(root: str, report: Callable[[str], None]) -> Callable[[str, tuple], None]:
    """A hook that reports and raises on every denied event."""
    def hook(event: str, args: tuple) -> None:
        violation = _violation(event, args, root)
        if violation:
            report(f"violation {violation}")
            raise SandboxViolation(violation)
    return hook


def _violation(event: str, args: tuple, root: str) -> Optional[str]:
    """Why `event` is denied, or None when it is allowed."""
    if event == "open":
        path, _mode, flags = args
        if flags & _WRITE_FLAGS and not isinstance(path, int) and not _inside(path, root):
            return f"filesystem: write to {path} outside the sandbox directory"
        return None
    if event in _PATH_EVENTS:
        outside = [arg for arg in args if isinstance(arg, (str, bytes, os.PathLike)) and not _inside(arg, root)]
        return f"filesystem: {event} on {outside[0]} outside the sandbox directory" if outside else None
    if event == "socket.__new__" or not event.startswith(_DENIED_PREFIXES):
        return None
    kind = next(kind for prefix, kind in _DENIED_EVENTS.items() if event.startswith(prefix))
    return f"{kind}: {event} denied"


def _inside(path: str | bytes | os.PathLike, root: str) -> bool:
    real = os.path.realpath(os.fsdecode(path))
    return real == root or real.startswith(root + os.sep)

