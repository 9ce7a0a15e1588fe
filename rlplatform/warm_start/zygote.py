"""The node's warm interpreter: imports the actors' modules once, then forks each Ray worker from itself.

Started by the first `launcher` on a node (one per raylet, in Ray's session, its own process group), it binds the
raylet's socket, imports torch, transformers, Ray and the modules of the job's actors (and those the raylet's
environment names in RLP_WARM_PRELOAD: vLLM's for a job on vLLM), and serves: for each
launcher it forks a child that takes the launcher's arguments, environment, directory and standard streams (with
its process group, niceness and signal mask) and runs Ray's `default_worker.py`
as `python default_worker.py ...` would, without importing anything again. It reports each child's pid and exit
status to its launcher, and exits when its raylet is gone. It runs one thread, and its imports run with one
OpenMP thread, so that no thread is lost to a fork; a child sets torch's threads from its own environment. Where
its imports have drawn a random Ray id (forks would then share Ray's ids: `ray_ids_fork_safe`), it forks nothing
and each launcher runs its worker itself.
"""

import contextlib
import errno
import fcntl
import importlib
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import threading
import traceback

import psutil

PRELOAD = (  # the modules of the actors a job starts, with torch, transformers, DeepSpeed and Ray under them
    "ray._private.worker",  # what Ray's default_worker.py imports (the script itself parses arguments at import)
    "rlplatform.learners.rank",
    "rlplatform.actors.rollout",
    "rlplatform.actors.evaluator",
    "rlplatform.actors.teacher",
    "rlplatform.rewards.worker",
    "rlplatform.transport.weight_store",
    "rlplatform.envs.tool_worker",
    "rlplatform.monitoring.watchdog",
)


def _preload() -> None:
    """PRELOAD, then the modules the raylet's environment names (`RLP_WARM_PRELOAD`, comma-separated: vLLM's for a
    job on vLLM); one of those that does not import is left to the workers, said in one line."""
    os.environ["OMP_NUM_THREADS"] = "1"  # no OpenMP pool thread before the forks; each child sets its own
    for name in PRELOAD:
        importlib.import_module(name)
    for name in filter(None, os.environ.get("RLP_WARM_PRELOAD", "").split(",")):
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 (the workers import it themselves, and fail there if they must)
            print(f"warm interpreter: {name} not preloaded ({type(err).__name__}: {err}); its workers import it",
                  flush=True)


def ray_ids_fork_safe() -> bool:
    """Whether two forks of this process draw different random Ray ids. Ray seeds its generator once per process,
    so after a draw here (`ray.remote` on a class draws its id) every fork would repeat the others' ids: the
    actors' modules make their classes on first use (rlplatform.actor_classes)."""
    import ray._raylet

    drawn = []
    for _ in range(2):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(write, ray._raylet.ObjectID.from_random().binary())
            os._exit(0)
        os.close(write)
        drawn.append(os.read(read, 64))
        os.close(read)
        os.waitpid(pid, 0)
    return drawn[0] != drawn[1]


def _raylet_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _recv_request(conn: socket.socket) -> tuple:
    header, fds, _flags, _addr = socket.recv_fds(conn, 4, 4)
    if len(header) < 4 or len(fds) != 4:
        raise EOFError
    (size,) = struct.unpack("!I", header)
    body = conn.recv(size, socket.MSG_WAITALL)  # all of it, or less at the end of the stream
    if len(body) < size:
        raise EOFError
    return json.loads(body), fds


def _watch_launcher(alive_fd: int) -> None:
    """Kill this worker when its launcher is gone (the raylet kills the launcher it started)."""
    def watch() -> None:
        while os.read(alive_fd, 1):
            pass
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def _become_worker(request: dict, fds: list) -> None:
    """In the forked child: take the launcher's process group, niceness, signal mask, streams, environment,
    directory and arguments; run the worker."""
    try:
        os.setpgid(0, request["pgid"])  # a signal to the launcher's group reaches its worker as it would
    except OSError:  # a group of another session
        os.setsid()
    with contextlib.suppress(OSError):  # raising priority may be refused
        os.setpriority(os.PRIO_PROCESS, 0, request["niceness"])
    for sig in request["ignored"]:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, request["blocked"])
    for index, fd in enumerate(fds[:3]):
        os.dup2(fd, index)
        os.close(fd)
    _watch_launcher(fds[3])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    sys.argv = list(argv)
    script_dir = os.path.dirname(os.path.abspath(argv[0]))
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[:] = [script_dir, *extra, *sys.path[1:]]
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit() and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))
    runpy.run_path(argv[0], run_name="__main__")


def serve(path: str, raylet_pid: int) -> None:
    lock = open(path + ".lock", "w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EAGAIN, errno.EACCES):
            return  # another warm interpreter serves this raylet
        raise
    if os.path.exists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    _preload()
    forks_safe = ray_ids_fork_safe()
    if not forks_safe:
        print("warm interpreter: its imports drew a random Ray id, which its forks would share; the workers of this "
              "raylet start unforked", flush=True)
    me = os.getpid()
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    launchers = {}  # child pid -> its launcher's connection
    try:
        while _raylet_alive(raylet_pid):
            for key, _ in selector.select(timeout=1.0):
                if key.fileobj is listener:
                    conn, _ = listener.accept()
                    if not forks_safe:  # the launcher runs its worker itself
                        with contextlib.suppress(OSError):
                            conn.sendall(b"N")
                        conn.close()
                        continue
                    pid = _fork_worker(conn, [listener, lock, *launchers.values()], (wake_read, wake_write))
                    if pid:
                        launchers[pid] = conn
                else:
                    os.read(wake_read, 4096)
            _reap(launchers)
    finally:
        if os.getpid() == me:
            os.unlink(path)


def _fork_worker(conn: socket.socket, inherited: list, wake: tuple) -> int:
    """Fork a worker for the launcher on `conn`; returns its pid (0 when the launcher went away)."""
    try:
        conn.settimeout(10)
        conn.sendall(b"R")
        request, fds = _recv_request(conn)
    except (OSError, EOFError, ValueError):
        conn.close()
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)  # what the launcher ignores is ignored again in `_become_worker`
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a Python just started
        for item in (*inherited, conn):
            item.close()
        for fd in wake:
            os.close(fd)
        code = 0
        try:
            _become_worker(request, fds)
        except SystemExit as stop:
            code = stop.code
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.exit(code)
    for fd in fds:
        os.close(fd)
    try:
        conn.sendall(struct.pack("!i", pid))
    except OSError:
        pass
    return pid


def _reap(launchers: dict) -> None:
    while launchers:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = launchers.pop(pid, None)
        if conn is not None:
            try:
                conn.sendall(struct.pack("!i", status))
            except OSError:
                pass
            conn.close()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
