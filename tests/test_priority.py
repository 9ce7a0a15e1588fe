"""CPU priorities: `set_cpu_priority` lowers every thread of its process (on Linux niceness is per
thread), and the evaluator's process takes its priority before loading torch. tests/job/test_signals.py checks
a real job's actors."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

CHILD = """
import json, os, sys, threading
from rlplatform.priority import set_cpu_priority
started = threading.Event()
thread = threading.Thread(target=lambda: (started.set(), threading.Event().wait(30)), daemon=True)
thread.start()
started.wait()
set_cpu_priority(sys.argv[1])
tids = [threading.get_native_id(), thread.native_id]
print(json.dumps([os.getpriority(os.PRIO_PROCESS, t) for t in tids]))
"""


def _priorities_after(priority: str, niceness: int = 0) -> list:
    """The nicenesses of a process's main thread and a thread it started before
    calling set_cpu_priority(priority), the process started at `niceness`."""
    out = subprocess.run(["nice", "-n", str(niceness), sys.executable, "-c", CHILD, priority], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    return json.loads(out)


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread priorities are Linux's")
def test_low_and_idle_lower_every_thread_and_normal_none():
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert _priorities_after("normal") == [base] * 2
    assert _priorities_after("low") == [min(base + 4, 19)] * 2
    assert _priorities_after("low", niceness=17) == [19] * 2  # capped at the lowest
    assert _priorities_after("idle") == [19] * 2


EVALUATOR_CHILD = """
import json, os, sys
seen = {}

class Watch:  # notes this process's niceness when torch is first imported
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            seen.setdefault("torch", os.getpriority(os.PRIO_PROCESS, 0))
        return None

sys.meta_path.insert(0, Watch())
from rlplatform.actors.evaluator import EvaluatorWorker
seen["module"] = "torch" in sys.modules
import pickle
spec = pickle.loads(bytes.fromhex(sys.argv[1]))  # as Ray hands it the constructor's arguments
seen["spec"] = "torch" in sys.modules
try:
    EvaluatorWorker(spec)  # no prompts file: it fails once the worker's module is loaded
except FileNotFoundError:
    pass
print(json.dumps(seen))
"""


def test_the_evaluator_takes_its_priority_before_it_loads_torch():
    """Ray imports an actor's module, then unpickles its arguments, before its constructor runs: neither the
    evaluator's module nor its spec (the weight transport's strategy included) loads torch, and its constructor
    lowers the process before it loads the rollout worker's module, which loads torch."""
    from rlplatform.actors.rollout_spec import RolloutSpec
    from rlplatform.config import RLConfig, RolloutConfig
    from rlplatform.transport.weight_transports import ObjectStoreTransport

    spec = RolloutSpec(0, "policy", "job", "/missing", "/missing", redis_url="redis://127.0.0.1:1", rl=RLConfig(),
                       rollout=RolloutConfig(),
                       dtype="float32", transport=ObjectStoreTransport(delta_full_every=5), priority="idle")
    out = subprocess.run([sys.executable, "-c", EVALUATOR_CHILD, pickle.dumps(spec).hex()], capture_output=True,
                         text=True, check=True, timeout=120).stdout
    assert json.loads(out) == {"module": False, "spec": False, "torch": 19}
