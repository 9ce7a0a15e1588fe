"""Code-test reward: runs a completion's Python code, then the row's tests, in a sandboxed process.

Consumes a `Sample` whose row holds `tests` (Python source, usually asserts) and produces 1.0
only when the code and every test run to the end. `run_in_sandbox` does the work and says why
a run failed. This file is also the sandbox's bootstrap: the child interpreter runs it as a script.
"""

from __future__ import annotations

import ctypes
import json
import linecache
import math
import os
import re
import resource
import secrets
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Callable, Dict, List, Optional

if TYPE_CHECKING:  # the sandbox child runs this file without site-packages: no rlplatform there
    from rlplatform.transport.samples import Sample

SANDBOX_UID_BASE = 200_000  # a run as root gets uid SANDBOX_UID_BASE + its pid: unique among live runs
MAX_PROCESSES = 64  # RLIMIT_NPROC: processes and threads of the run's uid
MAX_FILE_BYTES = 16 << 20  # RLIMIT_FSIZE, which also caps what stdout and stderr can hold
MAX_OPEN_FILES = 64
TAIL_BYTES = 2000  # how much of stdout and stderr a result keeps
KILL_WAIT_S = 5.0  # how long to keep killing survivors before giving up

_FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)

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
_CLONE_NEWNET = 0x40000000
_PR_SET_KEEPCAPS, _PR_SET_NO_NEW_PRIVS = 8, 38
_CAPABILITY_VERSION_3, _CAP_DAC_READ_SEARCH = 0x20080522, 2


@dataclass
class SandboxResult:
    passed: bool  # the code and all tests ran to the end
    reason: str  # "passed", or "<kind>: <detail>"; kinds: failed, error, timeout, memory, network,
    #              filesystem, process, native, killed, exited
    duration_s: float
    stdout_tail: str
    stderr_tail: str
    isolation: str  # the layers that applied, e.g. "netns rlimits uid=201234 audit"


class SandboxViolation(PermissionError):
    """Raised inside the sandbox by the audit hook."""


def code_tests(sample: Sample, *, timeout_s: float = 5.0, memory_mb: int = 512) -> float:
    """1.0 when the completion's code passes every test in the row's `tests`, else 0.0.

    The code is the last ```python fenced block of the completion, or the whole completion.
    timeout_s: wall-clock seconds for the code and the tests together.
    memory_mb: address-space limit of the sandboxed interpreter.
    """
    result = run_in_sandbox(extract_code(sample.completion), sample.tests, timeout_s=timeout_s, memory_mb=memory_mb)
    return float(result.passed)


def extract_code(completion: str) -> str:
    """The last fenced code block (```python, ```py or bare ```), else the whole completion."""
    blocks = _FENCED.findall(completion)
    return blocks[-1] if blocks else completion


def run_in_sandbox(code: str, tests: str, timeout_s: float = 5.0, memory_mb: int = 512) -> SandboxResult:
    """Run `code`, then `tests`, in one namespace in a sandboxed interpreter; never raises for their faults.

    A run passes only when the bootstrap reports that the tests ran to the end: a zero exit
    status is not enough (the code could call `os._exit(0)` first).

    Isolation, outermost first (`SandboxResult.isolation` lists the layers that applied):
    - a fresh scratch directory as cwd, HOME and TMPDIR, deleted afterwards; `python -I -S -B -u`;
    - its own session, SIGKILLed as a group when the run ends or times out;
    - a new network namespace (`unshare(CLONE_NEWNET)`: no interfaces but a down loopback), when
      permitted (needs root or CAP_SYS_ADMIN);
    - rlimits: address space (`memory_mb`), CPU seconds, processes, file size, open files, core;
    - as root: its own uid (SANDBOX_UID_BASE + pid), so RLIMIT_NPROC binds, root-owned files are
      read-only, and every process of that uid is killed at the end, escaped sessions included.
      It keeps one capability, CAP_DAC_READ_SEARCH, because the interpreter may live where only
      root can read (a pyenv under /root, as on the development machine); no_new_privs stops
      setuid binaries from granting more.
    - an audit hook (PEP 578) that denies sockets, process creation, signals, ctypes, and writes
      outside the scratch directory, naming what was attempted. Audit hooks are not a security
      boundary on their own (`_posixsubprocess.fork_exec` bypasses them); the layers above bound
      what a bypass can do.
    """
    nonce = secrets.token_hex(16)  # marks the bootstrap's report lines: printing "passed" or exiting early is no pass
    job = json.dumps({"nonce": nonce, "code": code, "tests": tests}).encode()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rlp-sandbox-", ignore_cleanup_errors=True) as scratch, \
            tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr, \
            tempfile.TemporaryFile() as report:
        args = [sys.executable, "-I", "-S", "-B", "-u", os.path.abspath(__file__),
                str(memory_mb), str(math.ceil(timeout_s) + 1), str(report.fileno())]
        proc = subprocess.Popen(args, cwd=scratch, env={"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch},
                                stdin=subprocess.PIPE, stdout=stdout, stderr=stderr,
                                pass_fds=(report.fileno(),), start_new_session=True)
        timed_out = _wait(proc, job, timeout_s)
        _kill_sandbox(proc, SANDBOX_UID_BASE + proc.pid if os.geteuid() == 0 else None)
        lines = _report_lines(report, nonce)
        reason = lines.get("outcome") or _reason_without_outcome(proc.returncode, timed_out, timeout_s)
        return SandboxResult(reason == "passed", reason, time.monotonic() - start,
                             _tail(stdout), _tail(stderr), lines.get("isolation", ""))


def _wait(proc: subprocess.Popen, job: bytes, timeout_s: float) -> bool:
    """Send the job and wait for the sandbox to exit; True when it ran out of time."""
    try:
        proc.communicate(job, timeout=timeout_s)
        return False
    except subprocess.TimeoutExpired:
        return True


def _kill_sandbox(proc: subprocess.Popen, uid: Optional[int]) -> None:
    """SIGKILL the run's process group, then every live process left in it or running as its uid."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    deadline = time.monotonic() + KILL_WAIT_S
    while (survivors := _live_processes(proc.pid, uid)) and time.monotonic() < deadline:
        for pid in survivors:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _live_processes(pgid: int, uid: Optional[int]) -> List[int]:
    """Pids of processes, zombies aside, in process group `pgid` or running as `uid`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat_file:
                state, _ppid, group = stat_file.read().rsplit(")", 1)[1].split()[:3]
            owner = os.stat(f"/proc/{entry}").st_uid
        except (OSError, ValueError):  # not a process, or it just exited
            continue
        if state != "Z" and (int(group) == pgid or owner == uid):
            found.append(int(entry))
    return found


def _report_lines(report: IO[bytes], nonce: str) -> Dict[str, str]:
    """The bootstrap's `<nonce> <key> <value>` lines as {key: value}; the first line of a key wins."""
    report.seek(0)
    lines = {}
    for line in report.read().decode(errors="replace").splitlines():
        marker, _, rest = line.partition(" ")
        key, _, value = rest.partition(" ")
        if marker == nonce:
            lines.setdefault(key, value)
    return lines


def _reason_without_outcome(returncode: int, timed_out: bool, timeout_s: float) -> str:
    """Why a run that never reported an outcome ended."""
    if timed_out:
        return f"timeout: still running after {timeout_s:g} s"
    if returncode == -signal.SIGXCPU:
        return "timeout: CPU time limit"
    if returncode < 0:
        return f"killed: {signal.Signals(-returncode).name}"
    return f"exited: exit code {returncode} before the tests finished"


def _tail(output: IO[bytes]) -> str:
    output.seek(0, os.SEEK_END)
    output.seek(max(0, output.tell() - TAIL_BYTES))
    return output.read().decode(errors="replace")


# ---- the sandbox child: everything below runs inside it ----

def _sandbox_main(memory_mb: int, cpu_s: int, report_fd: int) -> None:
    """Isolate this process, run the job read from stdin, report the outcome and exit."""
    job = json.loads(sys.stdin.buffer.read())
    nonce, write, exit_now = job["nonce"], os.write, os._exit  # bound before untrusted code runs
    layers = _isolate(memory_mb, cpu_s)
    violations: List[str] = []
    sys.addaudithook(_audit_hook(os.path.realpath(os.getcwd()), violations))
    write(report_fd, f"{nonce} isolation {' '.join(layers + ['audit'])}\n".encode())
    outcome = _run_untrusted(job["code"], job["tests"], violations)
    write(report_fd, f"{nonce} outcome {outcome}\n".encode(errors="replace"))
    exit_now(0)


def _isolate(memory_mb: int, cpu_s: int) -> List[str]:
    """Apply the kernel-level layers this process is allowed to; returns their names."""
    libc = ctypes.CDLL(None, use_errno=True)
    layers = ["netns"] if libc.unshare(_CLONE_NEWNET) == 0 else []
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    for limit, value in ((resource.RLIMIT_AS, memory_mb << 20), (resource.RLIMIT_CPU, cpu_s),
                         (resource.RLIMIT_NPROC, MAX_PROCESSES), (resource.RLIMIT_FSIZE, MAX_FILE_BYTES),
                         (resource.RLIMIT_NOFILE, MAX_OPEN_FILES), (resource.RLIMIT_CORE, 0)):
        hard = resource.getrlimit(limit)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(limit, (value, value))
    layers.append("rlimits")
    uid = SANDBOX_UID_BASE + os.getpid()
    if os.geteuid() == 0 and _switch_uid(libc, uid):
        layers.append(f"uid={uid}")
    return layers


def _switch_uid(libc: ctypes.CDLL, uid: int) -> bool:
    """Become `uid` (owning the scratch directory), keeping only CAP_DAC_READ_SEARCH; False if not permitted."""
    os.chown(".", uid, uid)
    libc.prctl(_PR_SET_KEEPCAPS, 1, 0, 0, 0)
    try:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    except OSError:
        return False
    keep = 1 << _CAP_DAC_READ_SEARCH
    header = (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0)
    sets = (ctypes.c_uint32 * 6)(keep, keep, 0, 0, 0, 0)  # effective, permitted, inheritable (x2 words)
    if libc.capset(header, sets) != 0:
        raise OSError(ctypes.get_errno(), "capset failed; refusing to run untrusted code with capabilities left")
    return True


def _audit_hook(root: str, violations: List[str]) -> Callable[[str, tuple], None]:
    """A hook that records and raises on every denied event."""
    def hook(event: str, args: tuple) -> None:
        violation = _violation(event, args, root)
        if violation:
            violations.append(violation)
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


def _run_untrusted(code: str, tests: str, violations: List[str]) -> str:
    """Run the code, then the tests, in one namespace; "passed" or why not."""
    run, build = exec, compile  # bound before the untrusted code can replace the builtins
    namespace = {"__name__": "__main__"}
    for filename, source, kind in (("solution.py", code, "error"), ("tests.py", tests, "failed")):
        linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # for tracebacks
        try:
            run(build(source, filename, "exec"), namespace)
        except BaseException as err:  # untrusted code may raise anything, SystemExit included
            traceback.print_exception(type(err), err, err.__traceback__.tb_next)  # from the untrusted frame on
            return violations[0] if violations else _describe(kind, filename, err)
    return violations[0] if violations else "passed"


def _describe(kind: str, filename: str, err: BaseException) -> str:
    """One line naming the exception and the line of `filename` it came from."""
    if isinstance(err, MemoryError):
        return f"memory: MemoryError in {filename}"
    lines = [frame.lineno for frame in traceback.extract_tb(err.__traceback__) if frame.filename == filename]
    where = f" line {lines[-1]}" if lines else ""
    detail = f": {err}" if str(err) else ""
    return f"{kind}: {type(err).__name__} in {filename}{where}{detail}"[:300].replace("\n", " ")


if __name__ == "__main__":
    _sandbox_main(*map(int, sys.argv[1:4]))
