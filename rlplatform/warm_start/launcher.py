"""Starts one Ray worker process on this node: forked from the node's warm interpreter, else a plain `python`.

Ray runs this file by path (so that it imports nothing but the standard library) as its workers' Python (see
`rlplatform.warm_start`), with the worker's own arguments (`default_worker.py ...`). It asks the node's warm
interpreter (`rlplatform.warm_start.zygote`, which has imported torch, transformers, Ray and the actors' modules
once) to fork the worker with this process's arguments, environment, directory, standard streams, process group,
niceness and signal mask, and starting that interpreter when the node has none. It then stands in for the worker
towards the raylet, which started it: it passes on SIGTERM, SIGINT and SIGHUP, and ends as the worker ends (its
exit status, or the signal that killed it); the worker ends when this process is killed. On a machine with a GPU,
where no warm interpreter answers, or for anything but Ray's worker script, Python runs here as it would have.
"""

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time

ZYGOTE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "zygote.py")
STARTUP_S = 30.0  # how long a starting warm interpreter may take to bind its socket
MAX_SOCKET_PATH = 100  # AF_UNIX paths are limited to 108 bytes
GPU_DEVICES = ("/dev/nvidiactl", "/dev/kfd")  # NVIDIA's and AMD's
WORKER_SCRIPT = "default_worker.py"  # Ray's worker; anything else the launcher is given runs as it would


def socket_path(worker_args: list) -> str:
    """The warm interpreter's socket for this raylet: in its session's sockets folder, one per raylet (several
    nodes of one cluster can share a machine and a session folder). Empty when Ray's arguments do not name one."""
    options = dict(arg[2:].split("=", 1) for arg in worker_args if arg.startswith("--") and "=" in arg)
    raylet = os.environ.get("RAY_RAYLET_PID")
    if not (raylet and "temp-dir" in options and "session-name" in options):
        return ""
    path = os.path.join(options["temp-dir"], options["session-name"], "sockets", f"rlp_warm_{raylet}")
    return path if len(path) <= MAX_SOCKET_PATH else ""


def _connect(path: str, start: bool) -> socket.socket:
    """A connection to the warm interpreter at `path`, started first when `start` and none answers."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        return conn
    except OSError:
        conn.close()
        if not start:
            raise
    log = open(path + ".log", "ab")
    subprocess.Popen([sys.executable, ZYGOTE, path, os.environ["RAY_RAYLET_PID"]], stdin=subprocess.DEVNULL,
                     stdout=log, stderr=log, process_group=0, close_fds=True)  # in Ray's session, its own group
    log.close()
    deadline = time.monotonic() + STARTUP_S
    while True:
        try:
            return _connect(path, start=False)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _read(conn: socket.socket, size: int) -> bytes:
    data = conn.recv(size, socket.MSG_WAITALL)  # all `size` bytes, or fewer at the end of the stream
    if len(data) < size:
        raise EOFError
    return data


def _exec_here(worker_args: list) -> None:
    os.execv(sys.executable, [sys.executable, *worker_args])


def main() -> None:
    worker_args = sys.argv[1:]
    is_worker = bool(worker_args) and os.path.basename(worker_args[0]) == WORKER_SCRIPT
    path = socket_path(worker_args) if is_worker and not any(map(os.path.exists, GPU_DEVICES)) else ""
    try:
        conn = _connect(path, start=True) if path else None
        if conn is not None and _read(conn, 1) != b"R":  # the interpreter is ready once its imports are done
            conn = None
    except (OSError, EOFError):
        conn = None
    if conn is None:
        _exec_here(worker_args)
    alive_read, alive_write = os.pipe()  # the worker watches its end: EOF when this process is gone
    request = json.dumps({
        "argv": worker_args, "env": dict(os.environ), "cwd": os.getcwd(), "pgid": os.getpgrp(),
        "niceness": os.getpriority(os.PRIO_PROCESS, 0),
        "blocked": [int(sig) for sig in signal.pthread_sigmask(signal.SIG_BLOCK, [])],
        "ignored": [int(sig) for sig in signal.valid_signals() if signal.getsignal(sig) == signal.SIG_IGN],
    }).encode()
    socket.send_fds(conn, [struct.pack("!I", len(request)) + request], [0, 1, 2, alive_read])
    os.close(alive_read)
    (pid,) = struct.unpack("!i", _read(conn, 4))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _frame: os.kill(pid, signum))
    try:
        (status,) = struct.unpack("!i", _read(conn, 4))
    except (OSError, EOFError):  # the warm interpreter is gone: wait for the worker itself
        while os.path.exists(f"/proc/{pid}"):
            time.sleep(0.5)
        sys.exit(1)
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        os.kill(os.getpid(), os.WTERMSIG(status))
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
