"""SIGINT and SIGTERM for a running job: the first asks for an orderly stop, a second ends at once.

While the RL loop runs, the first signal only sets a flag it polls: the loop finishes the learner
steps in flight, writes a checkpoint and returns. Anywhere else the first signal raises
`Interrupted` (like Ctrl-C), and a second signal always does; either way the controller
still writes summary.json (status `interrupted`) and stops every service it started.
Services start under `sigterm_held`, so a SIGTERM to the job's whole process group (what Slurm
and Kubernetes send) reaches the job alone, and the job stops them after its checkpoint.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator, Optional


class Interrupted(BaseException):
    """The job was stopped by a signal; `signum` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


@contextmanager
def sigterm_held() -> Iterator[None]:
    """Processes started within inherit SIGTERM blocked (a signal mask survives fork and exec)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class StopSignals:
    """Installed for the life of a job; `requested` tells the RL loop to wind down."""

    HANDLED = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self._polled = False
        self._previous = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        """The shell's convention: 128 + the signal number (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + (self.signum or 0)

    def install(self) -> None:
        """Take over SIGINT/SIGTERM (main thread only; elsewhere the defaults stay)."""
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.HANDLED}

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    @contextmanager
    def polled(self) -> Iterator[None]:
        """Within: a first signal only sets `requested`."""
        self._polled = True
        try:
            yield
        finally:
            self._polled = False

    def _handle(self, signum: int, frame) -> None:
        first = self.signum is None
        self.signum = self.signum or signum
        if first and self._polled:
            return
        raise Interrupted(self.signum)
