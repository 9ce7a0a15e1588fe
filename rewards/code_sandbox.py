"""Code-test reward: runs a completion's Python code and the row's tests in a sandbox of two processes.

Consumes a `Sample` whose row holds `tests` (Python source, usually asserts) and produces 1.0
only when every test passes. The code runs in one isolated process (`sandbox/solution.py`) and the
tests in another (`sandbox/judge.py`) that sees only the raw values the code returns, so nothing the
code does in its own process can change the verdict. `run_in_sandbox` does the work and says why
a run failed; the child processes start from `sandbox/child.py`.
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import KW_ONLY, dataclass
from typing import IO, TYPE_CHECKING, Dict, List, Set, Tuple

from rlplatform.rewards.verdict import Verdict
from rlplatform.rewards.sandbox.jail import SANDBOX_UID_BASE

if TYPE_CHECKING:
    from rlplatform.transport.samples import Sample

TAIL_BYTES = 2000  # how much of stdout and stderr a result keeps
KILL_WAIT_S = 5.0  # how long to keep killing survivors before giving up
REPORT_BYTES = 1 << 20  # how much of a report pipe is read
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox", "child.py")
PYTHON = os.path.realpath(sys.executable)  # the base interpreter: a virtualenv's directory is not in the sandbox

_FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
log = logging.getLogger(__name__)


@dataclass
class SandboxResult:
    passed: bool  # the judge ran every test to the end and the solution broke no rule
    reason: str  # "passed", or "<kind>: <detail>"; kinds: failed, error, exited, timeout, memory,
    #              network, filesystem, process, native, killed
    duration_s: float
    stdout_tail: str  # both processes' stdout
    stderr_tail: str  # both processes' stderr: the solution's traceback, or the failed test's
    _: KW_ONLY
    isolation: str  # the layers that applied to the solution, e.g. "namespaces rlimits uid=201234 audit"


class SandboxUnavailable(RuntimeError):
    """The kernel refuses the isolation the sandbox needs, and weak isolation was not allowed."""


def code_tests(sample: Sample, *, timeout_s: float = 5.0, memory_mb: int = 512,
               allow_weak_isolation: bool = False) -> Verdict:
    """1.0 when the completion's code passes every test in the row's `tests` (Python source, or a list of
    statements run one after another), else 0.0, as a `Verdict` whose reason is the run's kind (passed,
    failed, error, timeout, network, ...).

    The code is the last ```python fenced block of the completion, or the whole completion.
    timeout_s: wall-clock seconds for the code and the tests together.
    memory_mb: address-space limit of each sandboxed interpreter.
    allow_weak_isolation: score even where namespaces are unavailable (a non-root caller
    without user namespaces), with rlimits and the audit hook only; otherwise such a call
    raises SandboxUnavailable, which the scorer reports as an error result.
    Why a sample scored 0, in full, is logged at INFO under this module's logger.
    """
    result = run_in_sandbox(extract_code(sample.completion), _test_source(sample.tests), timeout_s=timeout_s,
                            memory_mb=memory_mb, allow_weak_isolation=allow_weak_isolation)
    if not result.passed:
        log.info("code_tests: sample %s scored 0: %s", sample.sample_id, result.reason)
    return Verdict(float(result.passed), result.reason.split(":", 1)[0])


def _test_source(tests) -> str:
    if isinstance(tests, list) and all(isinstance(test, str) for test in tests):
        return "\n".join(tests)
    if not isinstance(tests, str):
        raise TypeError(f"the row's 'tests' must be Python source or a list of statements, not {type(tests).__name__}")
    return tests


def extract_code(completion: str) -> str:
    """The last fenced code block (```python, ```py or bare ```), else the whole completion."""
    blocks = _FENCED.findall(completion)
    return blocks[-1] if blocks else completion


def run_in_sandbox(code: str, tests: str, timeout_s: float = 5.0, memory_mb: int = 512,
                   allow_weak_isolation: bool = False) -> SandboxResult:
    """Run `code` in a sandboxed solution process and `tests` in a sandboxed judge process that
    calls into it; never raises for their faults. Raises SandboxUnavailable when the kernel
    refuses namespaces and `allow_weak_isolation` is false.

    The verdict is the judge's: it reports "passed" on a pipe the solution cannot reach, only
    after every test ran, comparing values the solution returned as exact built-in types. The
    solution's own report can only veto (an error, or an attempt the audit hook denied).

    Isolation of both processes (`sandbox/jail.py`; `SandboxResult.isolation` lists what applied):
    - new mount, network (no interfaces but a down loopback), PID, IPC and UTS namespaces, and a
      user namespace when not root; the root is a read-only tmpfs holding only read-only binds of
      the system and Python directories, four devices and the run's scratch directory (writable
      by the solution only), so no way of opening a file reaches anything else;
    - rlimits: address space (`memory_mb`), CPU seconds, processes, file size, open files, core;
    - every capability dropped, bounding set included, and no_new_privs; as root, a uid of its
      own (SANDBOX_UID_BASE + pid), so RLIMIT_NPROC binds per run and every process of that uid
      is killed at the end;
    - in the solution, an audit hook (PEP 578) that names denied attempts (sockets, process
      creation, signals, ctypes, writes outside the scratch directory) and fails the run; the
      layers above hold where it is bypassed.
    Every process either starts inherits all of it; when the judge ends or `timeout_s` passes,
    both process groups and every process of the runs' uids are SIGKILLed.
    """
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rlp-sandbox-", ignore_cleanup_errors=True) as run_dir, \
            tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        scratch = _layout(run_dir)
        args = [str(memory_mb), str(math.ceil(timeout_s) + 1), str(int(allow_weak_isolation))]
        solution, judge, reports = _start(scratch, args, stdout, stderr)
        for proc, job in ((solution, code), (judge, tests)):
            _send(proc, job)
        timed_out = _wait(judge, timeout_s)
        _kill_sandbox([judge, solution])
        solution_lines, judge_lines = (_report_lines(fd) for fd in reports)
        refused = _refusal(solution_lines) or _refusal(judge_lines)
        if refused:
            raise SandboxUnavailable(f"code sandbox: {refused}")
        passed, reason = _verdict(solution_lines, judge_lines, judge.returncode, timed_out, timeout_s)
        return SandboxResult(passed, reason, time.monotonic() - start, _tail(stdout), _tail(stderr),
                             isolation=solution_lines.get("isolation", ""))


def _layout(run_dir: str) -> str:
    """Make the run's scratch directory (readable by the judge) and the sandboxes' root mount point."""
    scratch = os.path.join(run_dir, "work")
    for path in (scratch, os.path.join(run_dir, "root")):
        os.mkdir(path)
        os.chmod(path, 0o755)
    return scratch


def _start(scratch: str, args: List[str], stdout: IO[bytes], stderr: IO[bytes]) \
        -> Tuple[subprocess.Popen, subprocess.Popen, Tuple[int, int]]:
    """Start the solution and judge processes joined by two pipes, each with a report pipe."""
    to_solution, to_judge, solution_report, judge_report = os.pipe(), os.pipe(), os.pipe(), os.pipe()
    ends = {"solution": (solution_report[1], to_solution[0], to_judge[1]),
            "judge": (judge_report[1], to_judge[0], to_solution[1])}
    procs = {}
    try:
        for role, fds in ends.items():
            procs[role] = subprocess.Popen(
                [PYTHON, "-I", "-S", "-B", "-u", CHILD, role, *args, *map(str, fds)], cwd=scratch,
                env={"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch}, stdin=subprocess.PIPE,
                stdout=stdout, stderr=stderr, pass_fds=fds, start_new_session=True)
    finally:
        for fd in (*ends["solution"], *ends["judge"]):
            os.close(fd)
    for fd in (solution_report[0], judge_report[0]):
        os.set_blocking(fd, False)
    return procs["solution"], procs["judge"], (solution_report[0], judge_report[0])


def _send(proc: subprocess.Popen, job: str) -> None:
    try:
        proc.stdin.write(job.encode(errors="surrogatepass"))
        proc.stdin.close()
    except BrokenPipeError:  # it already ended (refused, or killed by a limit); its report says why
        pass


def _refusal(lines: Dict[str, str]) -> str:
    """Why the bootstrap refused to run, when it did: only as a report's first line, which it
    writes before any job runs (a solution that wrote one later would dodge its 0)."""
    return lines["unavailable"] if next(iter(lines), None) == "unavailable" else ""


def _verdict(solution: Dict[str, str], judge: Dict[str, str], returncode: int, timed_out: bool,
             timeout_s: float) -> Tuple[bool, str]:
    """Passed only on the judge's word with no veto from the solution; else the first reason."""
    vetoes = [solution[key] for key in ("violation", "error") if key in solution]
    outcome = judge.get("outcome")
    if outcome == "passed" and not vetoes:
        return True, "passed"
    reasons = [reason for reason in vetoes + [outcome] if reason and reason != "passed"]
    return False, reasons[0] if reasons else _reason_without_outcome(returncode, timed_out, timeout_s)


def _wait(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for the judge to exit; True when it ran out of time."""
    try:
        proc.wait(timeout=timeout_s)
        return False
    except subprocess.TimeoutExpired:
        return True


def _kill_sandbox(procs: List[subprocess.Popen]) -> None:
    """SIGKILL the processes' groups, then every live process left in them or running as their
    runs' uids (as root, a uid per process: SANDBOX_UID_BASE + its pid)."""
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    groups = {proc.pid for proc in procs}
    uids = {SANDBOX_UID_BASE + proc.pid for proc in procs} if os.geteuid() == 0 else set()
    deadline = time.monotonic() + KILL_WAIT_S
    while (survivors := _live_processes(groups, uids)) and time.monotonic() < deadline:
        for pid in survivors:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)


def _live_processes(groups: Set[int], uids: Set[int]) -> List[int]:
    """Pids of processes, zombies aside, in one of the process `groups` or running as one of `uids`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as stat_file:
                state, _ppid, group = stat_file.read().rsplit(")", 1)[1].split()[:3]
            owner = os.stat(f"/proc/{entry}").st_uid
        except (OSError, ValueError):  # not a process, or it just exited
            continue
        if state != "Z" and (int(group) in groups or owner in uids):
            found.append(int(entry))
    return found


def _report_lines(fd: int) -> Dict[str, str]:
    """A child's `<key> <value>` report lines as {key: value}, the first of a key winning; closes `fd`."""
    chunks = []
    try:
        while sum(map(len, chunks)) < REPORT_BYTES and (chunk := os.read(fd, 65536)):
            chunks.append(chunk)
    except BlockingIOError:  # a process of the run still holds the pipe open: what is there is all there is
        pass
    finally:
        os.close(fd)
    lines: Dict[str, str] = {}
    for line in b"".join(chunks).decode(errors="replace").splitlines():
        key, _, value = line.partition(" ")
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
