"""StopSignals without a job: while polled the first signal only asks for a stop, a second one
(or any signal outside the RL loop) raises `Interrupted`; exit codes follow 128 + signal. Starting Ray
leaves the caller's SIGTERM handler in place."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile

import pytest

from rlplatform.job.signals import Interrupted, StopSignals


def test_first_signal_in_the_rl_loop_asks_a_second_one_raises():
    stop = StopSignals()
    stop.install()
    try:
        with stop.polled():
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.requested and stop.exit_code == 143
            with pytest.raises(Interrupted):
                os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.restore()
    assert stop.exit_code == 143  # the first signal decides the exit code


def test_a_signal_outside_the_rl_loop_raises_at_once_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGINT)
    stop = StopSignals()
    stop.install()
    try:
        with pytest.raises(Interrupted) as stopped:
            os.kill(os.getpid(), signal.SIGINT)
        assert stopped.value.signum == signal.SIGINT and stop.exit_code == 130
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is before


def test_starting_ray_keeps_the_callers_sigterm_handler(tmp_path):
    """`ray.init` puts in a SIGTERM handler that exits with status 15; a job's own handler (and, after the
    job, the one it found) must stay, else a signal while Ray shuts down ends the job with 15."""
    script = """
import signal, sys
from rlplatform.config import load_config
from rlplatform.job.cluster import shutdown_ray, start_ray

def caller(signum, frame):
    pass

signal.signal(signal.SIGTERM, caller)
start_ray(load_config())
kept = signal.getsignal(signal.SIGTERM) is caller
shutdown_ray()
sys.exit(0 if kept and signal.getsignal(signal.SIGTERM) is caller else 3)
"""
    env = {**os.environ, "RAY_ADDRESS": "", "TMPDIR": tempfile.mkdtemp(prefix="t", dir="/tmp")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
