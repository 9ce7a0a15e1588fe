"""Code-test reward and its sandbox: correct and wrong solutions, and hostile code (loops, fork
bombs, huge allocations, sockets, writes outside the scratch directory) that must end in a 0
with a reason, within the time limit, leaving no process behind."""

from __future__ import annotations

import logging
import os
import subprocess
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from rlplatform.config import RewardSpec
from rlplatform.job.rl_loop import RLCounters, _count_scored, stage_figures
from rlplatform.transport.rollout_counters import RolloutCounters
from rlplatform.rewards.code_sandbox import code_tests, extract_code, run_in_sandbox
from rlplatform.rewards.worker import RewardWorker
from rlplatform.rewards.sandbox.jail import MAX_PROCESSES
from rlplatform.transport.reward_queue import RewardQueue

ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"


def run(code: str, tests: str = "", timeout_s: float = 2.0):
    """`run_in_sandbox`, checked to return within 5 s of its time limit, whatever the code does."""
    start = time.monotonic()
    result = run_in_sandbox(code, tests, timeout_s=timeout_s)
    assert time.monotonic() - start < timeout_s + 5
    return result


def run_uid(result) -> int:
    """The uid the run had to itself (as root), from its isolation layers."""
    layers = [layer for layer in result.isolation.split() if layer.startswith("uid=")]
    if not layers:
        pytest.skip(f"no per-run uid here ({result.isolation}): needs root")
    return int(layers[0][4:])


def live_processes(uid: int) -> list:
    """`ps` rows of processes, zombies aside, owned by `uid` (every process of a run as root)."""
    rows = subprocess.run(["ps", "-eo", "pid=,uid=,stat=,comm="], capture_output=True, text=True).stdout
    return [row for row in rows.splitlines() if int(row.split()[1]) == uid and not row.split()[2].startswith("Z")]


def test_correct_solution_scores_one(make_sample):
    completion = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nIt adds."
    assert code_tests(make_sample(completion, tests=ADD_TESTS)) == 1.0
    assert run("def add(a, b):\n    return a + b", ADD_TESTS).reason == "passed"


def test_wrong_solution_scores_zero_naming_the_failed_test(make_sample):
    assert code_tests(make_sample("def add(a, b):\n    return a * b\n", tests=ADD_TESTS)) == 0.0
    result = run("def add(a, b):\n    return abs(a) + b\n", ADD_TESTS)  # right for (2, 3) only
    assert (result.passed, result.reason) == (False, "failed: AssertionError in tests.py line 2")
    assert "assert add(-1, 1) == 0" in result.stderr_tail


def test_solution_that_raises_or_does_not_parse():
    assert run("x = 1 / 0", ADD_TESTS).reason == "error: ZeroDivisionError in solution.py line 1: division by zero"
    assert run("def add(a, b) return a", ADD_TESTS).reason.startswith("error: SyntaxError in solution.py")


def test_reason_for_a_zero_is_logged(make_sample, caplog):
    sample = make_sample("def add(a, b):\n    return a * b\n", tests=ADD_TESTS)
    with caplog.at_level(logging.INFO, logger="rlplatform.rewards.code_sandbox"):
        assert code_tests(sample) == 0.0
    assert "g0/0 scored 0: failed: AssertionError in tests.py line 1" in caplog.text


@pytest.mark.parametrize("code, tests", [
    # objects the tests call methods on, iterate, index and measure
    ("class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
     "        self.items.append(x)\n    def pop(self):\n        return self.items.pop()\n"
     "    def __len__(self):\n        return len(self.items)\n",
     "s = Stack()\ns.push(1)\ns.push(2)\nassert len(s) == 2 and s.pop() == 2 and s.items == [1]\n"),
    ("def count(n):\n    yield from range(n)\n", "assert list(count(3)) == [0, 1, 2]\nassert sum(count(4)) == 6\n"),
    # the solution's exceptions reach the tests as themselves
    ("def root(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x ** 0.5\n",
     "try:\n    root(-1)\nexcept ValueError as err:\n    assert str(err) == 'negative'\nelse:\n    assert False\n"
     "assert root(4) == 2\n"),
    # a list the solution sorts in place is sorted for the tests too; values keep their types
    ("def sort_in_place(xs):\n    xs.sort()\n",
     "xs = [3, 1, 2]\nsort_in_place(xs)\nassert xs == [1, 2, 3]\n"),
    ("def mixed():\n    return {'a': (1, 2.5), 'b': {3}, 'c': [None, True, b'x', 1j]}\n",
     "assert mixed() == {'a': (1, 2.5), 'b': {3}, 'c': [None, True, b'x', 1j]}\nassert mixed() != {'a': (1, 2.5)}\n"),
    ("def power(n):\n    return -3 ** n\n", "assert power(10000) == -3 ** 10000 and power(2) == -9\n"),
    # a module the solution imported is there for tests that forgot to import it
    ("import math\ndef area(r):\n    return math.pi * r * r\n", "assert math.isclose(area(1), math.pi)\n"),
])
def test_correct_solutions_of_many_shapes_pass(code, tests):
    result = run(code, tests)
    assert result.reason == "passed", result.stderr_tail


@pytest.mark.parametrize("code, tests", [
    # the tests' built-ins are their own, whatever the solution names its functions
    ("def all(xs):\n    return True\ndef is_even(n):\n    return False\n", "assert all([is_even(2), is_even(4)])\n"),
    # StopIteration from a call cannot end the loop that made it early
    ("def is_even(n):\n    raise StopIteration\n", "assert all(map(lambda n: is_even(n) == (n % 2 == 0), [1, 2]))\n"),
    # an object of the solution has no truth value and equals only itself
    ("class Yes:\n    def __bool__(self):\n        return True\ndef is_prime(n):\n    return Yes()\n",
     "assert is_prime(7)\n"),
])
def test_wrong_solutions_that_bend_the_tests_fail(code, tests):
    assert not run(code, tests).passed


def test_extract_code_takes_the_last_fenced_block():
    assert extract_code("a\n```python\nx = 1\n```\nb\n```py\nx = 2\n```") == "x = 2\n"
    assert extract_code("```\nx = 3\n```") == "x = 3\n"
    assert extract_code("x = 4") == "x = 4"


def test_leaving_early_is_not_a_pass():
    # a zero exit status is not enough: the bootstrap must report that the tests ran to the end
    assert run("import os\nos._exit(0)", "assert False").reason == "exited: the solution ended before the tests ran"
    assert run("import sys\nsys.exit(0)", "assert False").reason == "error: SystemExit in solution.py line 2: 0"
    skip_tests = "import builtins\nbuiltins.exec = lambda *args: None\nbuiltins.compile = lambda *args: None\n"
    assert run(skip_tests, "assert False").reason == "failed: AssertionError in tests.py line 1"


def test_runs_from_several_threads_are_independent():
    # the reward worker scores per-sample rewards on a thread pool
    codes = [("def add(a, b):\n    return a + b", 10.0)] * 3 + [("while True:\n    pass", 1.0)]
    with ThreadPoolExecutor(4) as pool:  # (room for four interpreters starting at once on a loaded machine)
        results = list(pool.map(lambda code: run(code[0], ADD_TESTS, timeout_s=code[1]), codes))
    assert [r.reason for r in results] == ["passed"] * 3 + ["timeout: still running after 1 s"]
    assert len({r.isolation for r in results}) == 4 or os.geteuid() != 0  # a uid of its own per run


def test_infinite_loop_times_out_and_is_killed():
    result = run("while True:\n    pass\n", timeout_s=1.0)
    assert (result.passed, result.reason) == (False, "timeout: still running after 1 s")
    assert 1.0 <= result.duration_s < 6.0
    assert live_processes(run_uid(result)) == []
    looping_call = run("def add(a, b):\n    while True:\n        pass\n", ADD_TESTS, timeout_s=1.0)
    assert looping_call.reason == "timeout: still running after 1 s"


def test_huge_allocation_is_a_memory_failure():
    result = run("block = bytearray(10 * 1024 ** 3)")  # 10 GB against the 512 MB address-space limit
    assert (result.passed, result.reason) == (False, "memory: MemoryError in solution.py")


@pytest.mark.parametrize("code, reason", [
    ("import socket\nsocket.socket().connect(('127.0.0.1', 80))", "network: socket.connect denied"),
    ("import socket\nsocket.create_connection(('localhost', 80))", "network: socket.getaddrinfo denied"),
    # caught inside the code, the attempt still fails the run
    ("import socket\ntry:\n    socket.socket().connect(('127.0.0.1', 80))\nexcept OSError:\n    pass\n"
     "def add(a, b):\n    return a + b\n", "network: socket.connect denied"),
])
def test_network_is_denied(code, reason):
    result = run(code, ADD_TESTS)
    assert (result.passed, result.reason) == (False, reason)


def test_writes_outside_the_scratch_directory_are_denied():
    outside = f"/tmp/outside-{uuid.uuid4().hex}"
    result = run(f"open({outside!r}, 'w').write('escaped')")
    assert (result.passed, result.reason) == (False, f"filesystem: write to {outside} outside the sandbox directory")
    assert not os.path.exists(outside)
    linked = run(f"import os\nos.symlink('/tmp', 'tmp')\nopen('tmp/{os.path.basename(outside)}', 'w')")
    assert linked.reason == "filesystem: os.symlink on /tmp outside the sandbox directory"
    assert run(f"import os\nos.mkdir({outside!r})").reason == \
        f"filesystem: os.mkdir on {outside} outside the sandbox directory"
    assert not os.path.exists(outside)


def test_scratch_directory_is_writable_and_removed_afterwards():
    code = "import os, tempfile\nopen('notes.txt', 'w').write('kept')\ntempfile.mkstemp()\nprint(os.getcwd())\n"
    result = run(code, "assert open('notes.txt').read() == 'kept'")
    assert result.reason == "passed"
    assert not os.path.exists(result.stdout_tail.strip())


@pytest.mark.parametrize("code, reason", [
    ("import os\nwhile True:\n    os.fork()", "process: os.fork denied"),
    ("import subprocess\nsubprocess.run(['true'])", "process: subprocess.Popen denied"),
    ("import os, signal\nos.kill(1, signal.SIGTERM)", "process: os.kill denied"),
    ("import ctypes\nctypes.CDLL(None).getpid()", "native: ctypes.dlopen denied"),
])
def test_process_creation_signals_and_ctypes_are_denied(code, reason):
    result = run(code)
    assert (result.passed, result.reason) == (False, reason)


def test_fork_bomb_that_bypasses_the_audit_hook_is_bounded_and_killed():
    """`_posixsubprocess` raises no audit event: this bomb is stopped by the kernel layers alone."""
    bomb = b"setsid sleep 60 & while :; do sleep 60 & done"  # one process escapes the group with setsid
    result = run("import multiprocessing.util as util\n"
                 f"util.spawnv_passfds(b'/bin/sh', [b'sh', b'-c', {bomb!r}], ())\n"
                 "while True:\n    pass\n", timeout_s=1.5)
    uid = run_uid(result)  # without one, RLIMIT_NPROC counts the caller's processes
    assert result.reason == "timeout: still running after 1.5 s"
    assert "fork" in result.stderr_tail  # the shell's complaint: RLIMIT_NPROC refused it more processes
    assert live_processes(uid) == []  # the `setsid` escapee included


def test_isolation_layers_reported_are_in_force():
    result = run("import os, resource, socket\nprint(os.getuid(), resource.getrlimit(resource.RLIMIT_NPROC)[0])\n"
                 "print(*[name for _index, name in socket.if_nameindex()], sorted(os.listdir('/')))")
    layers = result.isolation.split()
    assert result.reason == "passed" and {"rlimits", "audit"} <= set(layers)
    uid, nproc, interfaces, root = result.stdout_tail.split(maxsplit=3)
    assert int(nproc) <= MAX_PROCESSES
    uid_layer = [layer for layer in layers if layer.startswith("uid=")]
    assert uid_layer == [f"uid={uid}"] if uid_layer else int(uid) == os.geteuid()
    if "namespaces" in layers:
        assert interfaces == "lo"
        assert "etc" not in root and "proc" not in root and "home" not in root  # system directories only


def test_why_a_sample_scored_zero_reaches_the_summary_counted_per_reason(redis_server, redis_client, make_sample):
    """Scored by a real reward worker, read back from the results stream, counted as the RL loop does."""
    job = f"reasons-{uuid.uuid4().hex[:8]}"
    queue = RewardQueue(redis_client, job)
    queue.create_group()
    worker = RewardWorker("w", [RewardSpec(name="code_tests", params={"timeout_s": 3.0})], redis_server, job)
    completions = ["def add(a, b):\n    return a + b", "def add(a, b):\n    return a * b",
                   "def add(a, b):\n    while True: pass", "import socket\nsocket.socket().connect(('1.1.1.1', 80))"]
    queue.submit([replace(make_sample(c, tests=ADD_TESTS), sample_id=f"g0/{i}") for i, c in enumerate(completions)])
    while worker.step(block_ms=100):
        pass
    counters = RLCounters()
    for scored in queue.read_results():
        _count_scored(scored, counters)
    figures = stage_figures(counters, RolloutCounters(), 1, {}, 0, wall=1.0, trained_at_start=0, group_deadline_s=60.0)
    assert figures.reward_reasons == {"code_tests/failed": 1, "code_tests/network": 1, "code_tests/passed": 1,
                                         "code_tests/timeout": 1}
