"""Actor processes forked from a warm interpreter, instead of each importing torch and transformers anew.

Each of a job's actors is a Ray worker process, and each first imports torch, transformers, DeepSpeed and Ray:
about 8 CPU-seconds, most of a tiny job's start on a small machine. With `runtime_env()` as the job's runtime
environment, Ray starts each worker through `launcher.py`, which has the node's warm interpreter
(`zygote.py`: those modules imported once) fork it. Machines with a GPU start workers as Ray does: forking after
CUDA has been touched is unsafe, and there the imports are a small part of a job's start.
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Dict, Optional

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher.py")


def runtime_env() -> Dict[str, str]:
    """The runtime environment that starts a job's Ray workers through the launcher."""
    return {"py_executable": f"{shlex.quote(sys.executable)} {shlex.quote(LAUNCHER)}"}


def wanted(setting: Optional[bool], joins_cluster: bool) -> bool:
    """Whether a job with `ray.warm_start` `setting` forks its actors (unset: when it starts its own Ray)."""
    return not joins_cluster if setting is None else setting
