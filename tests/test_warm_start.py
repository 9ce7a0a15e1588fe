"""Workers forked from the warm interpreter: what each takes from its launcher, how it ends, and the way back to a
plain start. The launcher runs as Ray runs it, with a worker script and Ray's arguments; a `sleep` stands in for
the raylet the warm interpreter serves."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import ray

from rlplatform.warm_start import LAUNCHER, PRELOAD_ENV, VLLM_MODULES, local_workers_forked, vllm_modules
from tests.processes import alive

WORKER = """
import json, os, signal, sys, time
if "--wait" in sys.argv:  # before the report: the test signals once it has read it
    signal.signal(signal.SIGTERM, lambda *_: (print("terminated", flush=True), os._exit(5)))
report = {"argv": sys.argv, "cwd": os.getcwd(), "marker": os.environ.get("WARM_MARKER"), "pid": os.getpid(),
          "ppid": os.getppid(), "torch_before": "torch" in sys.modules, "wave_before": "wave" in sys.modules,
          "path0": sys.path[0],
          "extra_path": os.environ["PYTHONPATH"] in sys.path, "pgid": os.getpgrp(), "sid": os.getsid(0),
          "niceness": os.getpriority(os.PRIO_PROCESS, 0),
          "blocked": sorted(int(sig) for sig in signal.pthread_sigmask(signal.SIG_BLOCK, []))}
import torch
report["threads"] = torch.get_num_threads()
print(json.dumps(report), flush=True)
if "--wait" in sys.argv:
    time.sleep(600)
sys.exit(3)
"""


def wait_until(check, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _cmdline_or_empty(pid: int) -> str:
    try:
        return cmdline(pid)
    except OSError:
        return ""


@pytest.fixture
def node(tmp_path):
    """Ray's arguments naming a session folder, the environment a raylet gives its workers, and the worker script."""
    temp = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # short: socket paths must fit
    (temp / "session_x" / "sockets").mkdir(parents=True)
    raylet = subprocess.Popen(["sleep", "600"])
    script = tmp_path / "scripts" / "default_worker.py"  # named as Ray's worker: the launcher forks nothing else
    script.parent.mkdir()
    script.write_text(WORKER)
    extra = tmp_path / "user_code"
    extra.mkdir()
    env = {**os.environ, "RAY_RAYLET_PID": str(raylet.pid), "WARM_MARKER": "from-the-launcher", "OMP_NUM_THREADS": "2",
           "PYTHONPATH": str(extra)}
    args = [str(script), f"--temp-dir={temp}", "--session-name=session_x"]
    yield {"raylet": raylet, "env": env, "args": args, "socket": temp / "session_x" / "sockets" /
           f"rlp_warm_{raylet.pid}", "cwd": extra}
    raylet.kill()
    raylet.wait()
    shutil.rmtree(temp)


def launch(node: dict, *extra: str, env: dict = None, setup=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, LAUNCHER, *node["args"], *extra], env=env or node["env"],
                            cwd=node["cwd"], stdout=subprocess.PIPE, text=True, preexec_fn=setup)


def below_and_masked() -> None:
    """As a raylet may start its workers: in a group of their own, at a lower priority, SIGTERM blocked."""
    os.setpgid(0, 0)
    os.nice(3)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])


def test_a_worker_forks_from_the_warm_interpreter_with_its_launchers_arguments_environment_and_exit(node):
    # the raylet's environment names more modules to import (a job on vLLM names vLLM's: `vllm_modules`); one that
    # does not import is left to the workers, said in the warm interpreter's log
    first = launch(node, env={**node["env"], PRELOAD_ENV: "wave,no_such_module"}, setup=below_and_masked)
    out, _ = first.communicate(timeout=120)
    assert first.returncode == 3  # the worker's exit status, through the launcher
    report = json.loads(out)
    assert report["torch_before"]  # imported before the worker's code ran: forked, not started anew
    assert report["wave_before"]
    log = Path(f"{node['socket']}.log").read_text()
    assert "warm interpreter: no_such_module not preloaded (ModuleNotFoundError: " in log, log
    assert report["argv"] == [*node["args"]]
    assert report["cwd"] == str(node["cwd"]) and report["marker"] == "from-the-launcher" and report["extra_path"]
    assert report["path0"] == str(Path(node["args"][0]).parent)  # as `python default_worker.py` sets it
    assert report["threads"] == 2  # torch's threads from the worker's OMP_NUM_THREADS (the zygote imports with 1)
    # the launcher's group (a signal to it reaches the worker), session, priority and blocked signals
    assert report["pgid"] == first.pid and report["sid"] == os.getsid(0)
    assert report["niceness"] == min(os.getpriority(os.PRIO_PROCESS, 0) + 3, 19)
    assert report["blocked"] == [signal.SIGTERM]
    zygote = report["ppid"]
    assert "zygote.py" in cmdline(zygote) and report["pid"] != first.pid

    second = launch(node, env={**node["env"], "WARM_MARKER": "second"})
    report = json.loads(second.communicate(timeout=60)[0])
    assert report["ppid"] == zygote and report["marker"] == "second"  # one warm interpreter for the raylet
    # its own launcher's priority and mask, not those of the launcher that started the warm interpreter
    assert report["niceness"] == os.getpriority(os.PRIO_PROCESS, 0) and report["blocked"] == []

    node["raylet"].kill()  # the raylet gone, its warm interpreter leaves and takes its socket with it
    wait_until(lambda: not alive(zygote) and not node["socket"].exists())


def test_the_launcher_passes_on_sigterm_and_its_worker_dies_with_it(node):
    launcher = launch(node, "--wait")
    worker = json.loads(launcher.stdout.readline())["pid"]
    launcher.send_signal(signal.SIGTERM)  # passed on: the worker's handler runs and its exit status comes back
    assert launcher.wait(timeout=20) == 5 and launcher.stdout.readline() == "terminated\n"
    assert not alive(worker)

    launcher = launch(node, "--wait")
    worker = json.loads(launcher.stdout.readline())["pid"]
    launcher.kill()
    assert launcher.wait(timeout=20) == -signal.SIGKILL
    wait_until(lambda: not alive(worker))  # the worker sees its launcher gone


def test_without_a_raylet_to_serve_the_worker_starts_as_ray_would_start_it(node):
    env = {key: value for key, value in node["env"].items() if key != "RAY_RAYLET_PID"}
    launcher = launch(node, env=env)
    report = json.loads(launcher.communicate(timeout=60)[0])
    assert launcher.returncode == 3
    assert not report["torch_before"] and report["pid"] == launcher.pid  # the launcher became the worker (exec)
    assert not node["socket"].exists()


def test_what_is_not_rays_worker_runs_as_python_would_run_it(node):
    """Ray starts its agents, log monitor and reaper with the same Python as its workers: they run unforked."""
    other = Path(node["args"][0]).with_name("log_monitor.py")
    Path(node["args"][0]).rename(other)
    node["args"][0] = str(other)
    launcher = launch(node)
    report = json.loads(launcher.communicate(timeout=60)[0])
    assert launcher.returncode == 3 and not report["torch_before"] and report["pid"] == launcher.pid
    assert not node["socket"].exists()


def test_forks_of_the_warm_interpreter_draw_ray_ids_of_their_own():
    """The warm interpreter's imports (the actors' modules among them) draw no random Ray id: a draw before the
    forks would give every worker the same ids. Defining an actor class draws one, and the check sees it."""
    script = ("import json, ray\n"
              "from rlplatform.warm_start.zygote import _preload, ray_ids_fork_safe\n"
              "_preload()\n"
              "after_imports = ray_ids_fork_safe()\n"
              "ray.remote(type('Probe', (), {}))\n"
              "print(json.dumps([after_imports, ray_ids_fork_safe()]))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [True, False]


def test_where_the_warm_interpreters_imports_drew_a_ray_id_workers_start_unforked(node):
    # every Python started with the node's environment, the warm interpreter among them, defines an actor class
    (node["cwd"] / "sitecustomize.py").write_text("import ray\nray.remote(type('Drawn', (), {}))\n")
    launcher = launch(node)
    report = json.loads(launcher.communicate(timeout=120)[0])
    assert launcher.returncode == 3 and not report["torch_before"] and report["pid"] == launcher.pid
    wait_until(lambda: "start unforked" in Path(str(node["socket"]) + ".log").read_text())


def test_a_local_ray_started_in_the_block_takes_the_launcher_as_its_python_and_names_its_preload():
    """For a job on vLLM (`vllm_modules`), the raylet's environment names vLLM's modules while Ray starts, and only then."""
    assert vllm_modules(["transformers", "vllm"]) == VLLM_MODULES and vllm_modules(["transformers"]) == ()
    python, before = sys.executable, os.environ.get(PRELOAD_ENV)
    with local_workers_forked(VLLM_MODULES):
        script, preload = sys.executable, os.environ.get(PRELOAD_ENV)
    assert sys.executable == python and script != python and os.access(script, os.X_OK)
    assert preload == ",".join(VLLM_MODULES) and os.environ.get(PRELOAD_ENV) == before
    done = subprocess.run([script, "-c", "import sys; print(sys.executable)"], capture_output=True, text=True)
    assert done.stdout.strip() == python  # through the launcher, which ran no warm interpreter for it


class Probe:
    def where(self):
        return os.getpid(), os.getppid(), os.environ.get("WARM_MARKER"), ray.get_runtime_context().get_worker_id()


def test_a_ray_actor_runs_forked_and_ends_with_its_launcher(ray_session):
    """The tests' Ray session starts its actors as a job's: forked. An actor with a runtime environment of its own
    starts as Ray starts it, with that environment."""
    own_env = ray_session.remote(num_cpus=0, runtime_env={"env_vars": {"WARM_MARKER": "actor"}})(Probe).remote()
    pid, ppid, marker, _ = ray_session.get(own_env.where.remote())
    assert marker == "actor" and "zygote.py" not in cmdline(ppid)
    ray_session.kill(own_env)

    probe = ray_session.remote(num_cpus=0)(Probe).remote()
    pid, ppid, marker, worker_id = ray_session.get(probe.where.remote())
    assert "zygote.py" in cmdline(ppid)
    launchers = [int(proc.name) for proc in Path("/proc").iterdir() if proc.name.isdigit()
                 and f"--worker-id={worker_id}" in _cmdline_or_empty(int(proc.name))]
    assert len(launchers) == 1 and launchers != [pid]  # the process the raylet started stands in for the worker
    launcher = launchers[0]
    assert LAUNCHER in cmdline(launcher)
    ray_session.kill(probe)
    wait_until(lambda: not alive(pid) and not alive(launcher))
