"""Attacks a policy under RL could find on the code-test reward: each scores 1.0 with a wrong
solution, or reaches outside the run, unless the sandbox holds. Every one must end in a 0 (or a
refusal to score) and leave nothing behind outside the run's scratch directory."""

from __future__ import annotations

import json
import os
import platform
import re
import socket
import shutil
import subprocess
import sys
import tempfile
import textwrap
import uuid
from pathlib import Path

import pytest

import rlplatform.rewards.code_sandbox
from rlplatform.rewards.code_sandbox import run_in_sandbox

ADD_TESTS = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
WRONG_ADD = "def add(a, b):\n    return 0\n"
NOBODY = 65534
SYSTEM_PYTHON = "/usr/bin/python3"
SOURCES = os.path.dirname(rlplatform.rewards.code_sandbox.__file__)

FRAME_WALK = """
import sys, os
frame = sys._getframe()
while frame is not None:
    names = frame.f_locals
    if 'nonce' in names and 'report_fd' in names:
        os.write(names['report_fd'], f"{names['nonce']} outcome passed\\n".encode())
        os._exit(0)
    frame = frame.f_back
"""
GC_WALK = """
import gc
for obj in gc.get_objects():  # any list a harness closure holds (a list of reasons, say) gets a "passed"
    for cell in getattr(obj, '__closure__', None) or ():
        if type(cell.cell_contents) is list:
            cell.cell_contents.insert(0, 'passed')
"""
REPLACE_HARNESS = """
import __main__
__main__._describe = lambda *args: 'passed'
"""
TRACE_HARNESS = """
import sys
def tracer(frame, event, arg):
    for outer in (frame, frame.f_back):
        if outer is not None and isinstance(outer.f_locals.get('violations'), list):
            outer.f_locals['violations'][:] = ['passed']
    return tracer
sys.{hook}(tracer)
frame = sys._getframe()
while frame is not None:
    frame.f_trace = tracer
    frame = frame.f_back
"""
FAKE_REFUSAL = """
import os, sys
for line in (b"unavailable solution: no namespaces\\n", b"error passed\\n", b"outcome passed\\n"):
    os.write(int(sys.argv[5]), line)  # the report pipe's number, from the bootstrap's arguments
"""
ALWAYS_EQUAL = """
class Anything:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __hash__(self): return 0
    def __bool__(self): return True
def add(a, b):
    return Anything()
"""
LYING_INT = """
class Five(int):
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __hash__ = int.__hash__
def add(a, b):
    return Five(0)
"""
LYING_STR = """
class Text(str):
    def __eq__(self, other): return True
    __hash__ = str.__hash__
def greet(name):
    return Text('')
"""


@pytest.mark.parametrize("attack", [FRAME_WALK, GC_WALK, REPLACE_HARNESS, TRACE_HARNESS.format(hook="settrace"),
                                    TRACE_HARNESS.format(hook="setprofile"), FAKE_REFUSAL, ALWAYS_EQUAL, LYING_INT],
                         ids=["frames", "gc", "harness", "settrace", "setprofile", "fake-report", "always-equal",
                              "lying-int"])
def test_wrong_solution_cannot_report_its_own_pass(attack):
    result = run_in_sandbox(WRONG_ADD + attack, ADD_TESTS, timeout_s=3.0)
    assert not result.passed, result.reason


def test_answers_are_compared_type_strictly():
    assert not run_in_sandbox(LYING_STR, "assert greet('x') == 'hello x'\n", timeout_s=3.0).passed
    assert not run_in_sandbox("def is_one(x):\n    return True\n", "assert is_one(1) == 1\n", timeout_s=3.0).passed
    assert not run_in_sandbox("def pair():\n    return (1, 2)\n", "assert pair() == [1, 2]\n", timeout_s=3.0).passed


def test_root_only_files_are_unreadable():
    if os.geteuid() != 0:
        pytest.skip("needs root: the sandbox must not read what only root may")
    result = run_in_sandbox("print(open('/etc/shadow').read())", "", timeout_s=3.0)
    assert "root:" not in result.stdout_tail + result.stderr_tail


def test_another_jobs_private_file_is_unreadable(tmp_path):
    secret = f"redis://:{uuid.uuid4().hex}@10.0.0.1:6379/0"
    url_file = tmp_path / "redis.url"
    url_file.write_text(secret)
    url_file.chmod(0o600)
    os.chmod(tmp_path, 0o755)
    result = run_in_sandbox(f"print(open({str(url_file)!r}).read())", "", timeout_s=3.0)
    assert secret not in result.stdout_tail + result.stderr_tail


ESCAPES = {
    "dir-fd": "import os\nd = os.open({dir!r}, os.O_RDONLY)\n"
              "os.write(os.open({name!r}, os.O_WRONLY | os.O_CREAT, 0o666, dir_fd=d), b'escaped')\n",
    "spawned-shell": "import multiprocessing.util as util, os\n"
                     "script = b'echo escaped > {dir}/{name}; echo shell ran'\n"
                     "pid = util.spawnv_passfds(b'/bin/sh', [b'sh', b'-c', script], ())\n"
                     "os.waitpid(pid, 0)\n",
}


@pytest.mark.parametrize("where", ["/tmp", "/dev/shm"])
@pytest.mark.parametrize("how", sorted(ESCAPES))
def test_no_way_of_writing_reaches_outside(where, how):
    name = f"escaped-{uuid.uuid4().hex}"
    result = run_in_sandbox(ESCAPES[how].format(dir=where, name=name), "", timeout_s=3.0)
    escaped = os.path.exists(os.path.join(where, name))
    if escaped:
        os.remove(os.path.join(where, name))
    assert not escaped
    assert how != "spawned-shell" or "shell ran" in result.stdout_tail  # the attempt was made


def test_localhost_is_unreachable_even_bypassing_the_audit_hook():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.1)
        port = server.getsockname()[1]
        code = ("import multiprocessing.util as util, os\n"
                f"script = b'echo hi > /dev/tcp/127.0.0.1/{port}; echo bash ran'\n"
                "pid = util.spawnv_passfds(b'/bin/bash', [b'bash', b'-c', script], ())\n"
                "os.waitpid(pid, 0)\n")
        result = run_in_sandbox(code, "", timeout_s=3.0)
        with pytest.raises(socket.timeout):
            server.accept()
    assert "bash ran" in result.stdout_tail  # the attempt was made


@pytest.fixture
def nobody_dir():
    """A directory the user `nobody` can read, holding `rlplatform.rewards`' sandbox modules alone
    (the test interpreter lives under /root, out of nobody's reach: the system Python runs them)."""
    if os.geteuid() != 0 or not os.path.exists(SYSTEM_PYTHON):
        pytest.skip(f"needs root and {SYSTEM_PYTHON} to run code as nobody")
    path = tempfile.mkdtemp(prefix="rlp-nobody-")
    os.chmod(path, 0o755)
    rewards = os.path.join(path, "rlplatform", "rewards")
    os.makedirs(rewards)
    for package in (rewards, os.path.dirname(rewards)):
        open(os.path.join(package, "__init__.py"), "w").close()
    for name in os.listdir(SOURCES):
        if name in ("code_sandbox.py", "verdict.py", "sandbox"):
            os.symlink(os.path.join(SOURCES, name), os.path.join(rewards, name))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def as_nobody(directory: str, script: str, deny_unshare: bool = False) -> dict:
    """Run `script` (which ends by printing a JSON object) as the unprivileged user `nobody`
    from `directory`, with unshare(2) refused by a seccomp filter when `deny_unshare`; returns
    that object."""
    return run_script([SYSTEM_PYTHON, "-s"], directory, script, deny_unshare, user=NOBODY, group=NOBODY,
                      extra_groups=[])


def run_script(python: list, directory: str, script: str, deny_unshare: bool, **user) -> dict:
    path = os.path.join(directory, "script.py")
    with open(path, "w") as file:
        file.write((SECCOMP_DENY_UNSHARE if deny_unshare else "") + textwrap.dedent(script))
    os.chmod(path, 0o644)
    done = subprocess.run([*python, path], capture_output=True, text=True, timeout=120, cwd=directory,
                          env={"PATH": "/usr/bin:/bin", "HOME": directory}, **user)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


SECCOMP_DENY_UNSHARE = """
import ctypes, struct
def _deny_unshare():
    # BPF: load the syscall number; unshare (272 on x86_64) -> EPERM, anything else allowed
    code = (struct.pack("HBBI", 0x20, 0, 0, 0) + struct.pack("HBBI", 0x15, 0, 1, 272)
            + struct.pack("HBBI", 0x06, 0, 0, 0x00050000 | 1) + struct.pack("HBBI", 0x06, 0, 0, 0x7FFF0000))
    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, 2, ctypes.byref(Program(4, code)), 0, 0) == 0, ctypes.get_errno()  # seccomp filter
_deny_unshare()
"""


def test_unprivileged_caller_is_still_isolated(nobody_dir):
    secret = uuid.uuid4().hex
    job_file = os.path.join(nobody_dir, "redis.url")
    with open(job_file, "w") as file:
        file.write(secret)
    os.chown(job_file, NOBODY, NOBODY)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.1)
        port = server.getsockname()[1]
        code = (f"try:\n    print(open({job_file!r}).read())\nexcept OSError as err:\n    print(err)\n"
                "import multiprocessing.util as util, os\n"
                f"pid = util.spawnv_passfds(b'/bin/bash', [b'bash', b'-c', b'echo hi > /dev/tcp/127.0.0.1/{port}; "
                f"echo changed > {job_file}; echo bash ran'], ())\nos.waitpid(pid, 0)\n")
        found = as_nobody(nobody_dir, f"""
            import json
            from rlplatform.rewards.code_sandbox import run_in_sandbox
            result = run_in_sandbox({code!r}, "", timeout_s=5.0)
            print(json.dumps({{"out": result.stdout_tail + result.stderr_tail, "isolation": result.isolation}}))
            """)
        with pytest.raises(socket.timeout):
            server.accept()
    assert found["isolation"].split()[:2] == ["namespaces", "rlimits"] and "bash ran" in found["out"]
    assert secret not in found["out"]
    with open(job_file) as file:
        assert file.read() == secret


REFUSAL_SCRIPT = """
    import json
    from rlplatform.rewards.code_sandbox import SandboxUnavailable, run_in_sandbox
    code, tests = "def add(a, b):\\n    return a + b\\n", "assert add(2, 3) == 5\\n"
    try:
        run_in_sandbox(code, tests, timeout_s=5.0)
        refused = ""
    except SandboxUnavailable as err:
        refused = str(err)
    weak = run_in_sandbox(code, tests, timeout_s=5.0, allow_weak_isolation=True)
    print(json.dumps({"refused": refused, "weak": [weak.reason, weak.isolation]}))
"""


def test_without_namespaces_it_refuses_unless_weak_isolation_is_allowed(nobody_dir):
    if platform.machine() != "x86_64":
        pytest.skip("the seccomp filter names unshare by its x86_64 number")
    found = as_nobody(nobody_dir, REFUSAL_SCRIPT, deny_unshare=True)
    assert re.match(r"code sandbox: (solution|judge): unshare failed: Operation not permitted;",
                    found["refused"]), found
    assert "allow_weak_isolation: true" in found["refused"]
    assert found["weak"] == ["passed", "rlimits nocaps audit"]


def test_a_refusal_is_an_error_result_for_the_scorer(tmp_path):
    """Even as root: where a seccomp policy forbids unshare, the reward does not score."""
    if platform.machine() != "x86_64":
        pytest.skip("the seccomp filter names unshare by its x86_64 number")
    found = run_script([sys.executable], str(tmp_path), """
        import json
        from rlplatform.config import RewardSpec
        from rlplatform.rewards import resolve
        from rlplatform.rewards.scoring import Scorer
        from rlplatform.transport.samples import Sample
        row = {"tests": "assert add(2, 3) == 5\\n"}
        sample = Sample("g0/0", "g0", "policy", "", "def add(a, b):\\n    return a + b\\n", prompt_ids=[],
                        completion_ids=[0], behaviour_logprobs=[0.0], token_versions=[0], row=row)
        scored = Scorer(resolve([RewardSpec(name="code_tests")])).score([sample])[0]
        weak = RewardSpec(name="code_tests", params={"allow_weak_isolation": True})
        scored_weak = Scorer(resolve([weak])).score([sample])[0]
        print(json.dumps({"error": scored.error, "components": scored.components,
                          "weak": [scored_weak.error, scored_weak.components]}))
        """, deny_unshare=True)
    assert found["components"] == {}
    assert found["error"].startswith("code_tests: SandboxUnavailable: code sandbox: "), found
    assert "unshare failed: Operation not permitted" in found["error"]
    # weakly isolated, as root, the code runs under a uid of its own: it must be able to read Python
    python_closed = any(os.stat(path).st_mode & 0o005 != 0o005 for path in Path(sys.base_prefix).resolve().parents)
    if python_closed:
        assert "cannot read the Python installation" in found["weak"][0]
    else:
        assert found["weak"] == [None, {"code_tests": 1.0}]
