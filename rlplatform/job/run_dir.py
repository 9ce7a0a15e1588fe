"""A run directory's ownership: one live job per directory, and an earlier run's work never deleted.

`RunLock` holds an exclusive lock on `<run_dir>/.lock` for the job's life (the kernel releases it
however the process ends, SIGKILL included), taken before the job writes anything, so a second job
of the same name refuses to start instead of overwriting a live job's files. A start that does not
resume refuses where an earlier run left checkpoints (`check_fresh_start`), unless asked to move
that run aside (`move_aside`, `rlp run --fresh`). Each run has an id (`run_id`, kept in `<run_dir>/run_id`)
that scopes its Redis keys: new on a fresh start, the same when the run resumes.
"""

from __future__ import annotations

import fcntl
import os
import time
import uuid
from typing import Optional

from rlplatform.config import ConfigError, JobConfig
from rlplatform.job.checkpoint import latest_checkpoint

LOCK = ".lock"
RUN_ID = "run_id"


class RunLock:
    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK)
        self._fd: Optional[int] = None

    def __enter__(self) -> "RunLock":
        os.makedirs(self.run_dir, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise ConfigError(f"{self.run_dir} is in use by a running job (pid {holder}): wait for it to end or "
                              f"stop it, or give this run another name") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


def check_fresh_start(config: JobConfig) -> None:
    """A start that does not resume (`resume: never`) refuses where an earlier run left checkpoints."""
    checkpoint = latest_checkpoint(config.run_dir) if config.resume == "never" else None
    if checkpoint is not None:
        raise ConfigError(f"{config.run_dir} holds checkpoints of an earlier run (newest "
                          f"{os.path.basename(checkpoint)}): continue it with `rlp run --resume {config.run_dir}`, "
                          f"or start afresh with --fresh, which moves that run to {config.run_dir}.moved-<time>")


def move_aside(run_dir: str) -> Optional[str]:
    """Move what an earlier run left in `run_dir` (all but the lock) to `<run_dir>.moved-<time>`; returns that
    directory, or None when there was nothing to move."""
    entries = [name for name in os.listdir(run_dir) if name != LOCK] if os.path.isdir(run_dir) else []
    if not entries:
        return None
    moved = stamp = f"{run_dir}.moved-{time.strftime('%Y%m%d-%H%M%S')}"
    count = 1
    while os.path.exists(moved):  # two moves within a second
        count += 1
        moved = f"{stamp}-{count}"
    os.makedirs(moved)
    for name in entries:
        os.rename(os.path.join(run_dir, name), os.path.join(moved, name))
    return moved


def run_id(run_dir: str, resuming: bool) -> str:
    """This run's id: the one `run_dir` keeps when the run resumes a checkpoint of it, else a new one, kept there
    for a later resume."""
    kept = kept_run_id(run_dir) if resuming else None
    if kept is not None:
        return kept
    new = uuid.uuid4().hex[:12]
    with open(os.path.join(run_dir, RUN_ID), "w") as f:
        f.write(new + "\n")
    return new


def kept_run_id(run_dir: str) -> Optional[str]:
    """The id of the run whose directory is `run_dir` (None: it keeps none)."""
    try:
        with open(os.path.join(run_dir, RUN_ID)) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None
