"""StopSignals without a job: while polled the first signal only asks for a stop, a second one
(or any signal outside the RL loop) raises `Interrupted`; exit codes follow 128 + signal."""

from __future__ import annotations

import os
import signal

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
