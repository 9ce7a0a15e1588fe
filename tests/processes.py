"""What the process table says about a test's subprocesses (read from /proc), and the `rlp` command they run."""

from __future__ import annotations

import sys
from pathlib import Path

RLP = str(Path(sys.executable).parent / "rlp")  # the console script installed beside this Python


def proc_stat(pid: int) -> list:
    """Fields of /proc/<pid>/stat after the command name: state, ppid, pgrp, session, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    try:
        return proc_stat(pid)[0] != "Z"
    except OSError:
        return False


def session(sid: int) -> list:
    """Live processes, zombies aside, of session `sid`: (pid, the start of its command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            fields = proc_stat(int(entry.name))
        except (OSError, ValueError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append((int(entry.name), (entry / "cmdline").read_bytes()[:80]))
    return found
