"""Actor processes forked from a warm interpreter, instead of each importing torch and transformers anew.

Each of a job's actors is a Ray worker process, and each first imports torch, transformers, DeepSpeed and Ray:
about 8 CPU-seconds, most of a tiny job's start on a small machine. Ray starts such workers through `launcher.py`,
which has the node's warm interpreter (`zygote.py`: those modules imported once) fork it. A local Ray started
inside `local_workers_forked()` runs the launcher as its workers' Python; a job joining a cluster passes
`runtime_env()` instead, which costs each worker a start of Ray's `setup_worker.py` before it. Machines with a GPU
start workers as Ray does: forking after CUDA has been touched is unsafe, and there the imports are a small part
of a job's start.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import sys
import tempfile
from typing import Dict, Iterator, Optional, Sequence

from rlplatform.warm_start.launcher import GPU_DEVICES

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher.py")
PRELOAD_ENV = "RLP_WARM_PRELOAD"  # more modules the warm interpreter imports, comma-separated (zygote.py)
VLLM_MODULES = ("vllm.entrypoints.llm",)  # what a vLLM engine's start imports: 4-5 s of it on a CPU core


def runtime_env() -> Dict[str, str]:
    """The runtime environment that starts a job's Ray workers on a cluster it joins through the launcher."""
    return {"py_executable": f"{shlex.quote(sys.executable)} {shlex.quote(LAUNCHER)}"}


def wanted(setting: Optional[bool], joins_cluster: bool) -> bool:
    """Whether a job with `ray.warm_start` `setting` forks its actors (unset: when it starts its own Ray)."""
    return not joins_cluster if setting is None else setting


@contextlib.contextmanager
def local_workers_forked(preload: Sequence[str] = ()) -> Iterator[None]:
    """A local Ray started inside this block starts its workers through the launcher. The raylet's command for a
    worker is `sys.executable` as `ray.init` reads it, then `default_worker.py` and its arguments, so here
    `sys.executable` names a script that runs the launcher with this Python. The other Python processes Ray
    starts meanwhile (its agents, log monitor and reaper) go through the launcher to a plain Python, and so do
    workers whose actors ask for a runtime environment of their own (Ray starts those through `setup_worker.py`).
    `preload`: modules the node's warm interpreter imports beside its own (`vllm_modules`), passed in the
    raylet's environment, which the launcher and so the warm interpreter inherit.
    On a machine with a GPU nothing changes."""
    if any(os.path.exists(device) for device in GPU_DEVICES):
        yield
        return
    python, environment = sys.executable, os.environ.get(PRELOAD_ENV)
    sys.executable = _launcher_script(python)
    if preload:
        os.environ[PRELOAD_ENV] = ",".join(preload)
    try:
        yield
    finally:
        sys.executable = python
        if environment is None:
            os.environ.pop(PRELOAD_ENV, None)
        else:
            os.environ[PRELOAD_ENV] = environment


def vllm_modules(engines: Sequence[str]) -> Sequence[str]:
    """What the warm interpreter preloads for a job whose policies' rollout engines are `engines`: vLLM's, where
    one of them is vLLM (each vLLM worker forked from it then skips that import)."""
    return VLLM_MODULES if "vllm" in engines else ()


def _launcher_script(python: str) -> str:
    """An executable script running the launcher with `python`, kept in this user's temporary folder under a name
    its content determines (the raylet runs it for as long as its session lasts)."""
    text = f"#!/bin/sh\nexec {shlex.quote(python)} {shlex.quote(LAUNCHER)} \"$@\"\n"
    folder = os.path.join(tempfile.gettempdir(), f"rlplatform-{os.getuid()}")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    if os.stat(folder).st_uid != os.getuid():
        raise PermissionError(f"{folder} belongs to another user")
    path = os.path.join(folder, "python-" + hashlib.sha256(text.encode()).hexdigest()[:16])
    if not os.path.exists(path):
        with tempfile.NamedTemporaryFile("w", dir=folder, delete=False) as script:
            script.write(text)
        os.chmod(script.name, 0o755)
        os.replace(script.name, path)
    return path
