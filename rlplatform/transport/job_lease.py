"""One live job per name on a Redis: a job's keys are touched by that job alone.

A job's Redis keys are named after the job (`rlp:<name>:…`), and a starting job resets them. So that
a same-name job started elsewhere against the same Redis (another run directory, another machine)
never resets a live job's queue, status or counters, a job holds the lease `rlp:<name>:owner` from
before it writes any key of its name until it ends. The lease names its holder (host, pid, run
directory) and expires `ttl_s` after its last renewal, renewed by a daemon thread, so a job killed
outright frees its name within `ttl_s`. A second job of the name refuses to start in one line.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from typing import Optional

import redis

from rlplatform.config import ConfigError
from rlplatform.transport.reward_queue import JobKeys

TTL_S = 30.0

# renew the lease only while this holder still holds it
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
return redis.call('set', KEYS[1], ARGV[1], 'px', ARGV[2], 'nx') and 1 or 0
"""
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


class JobLease:
    """`with JobLease(client, job, run_dir):` holds job `job`'s name on `client`'s Redis."""

    def __init__(self, client: redis.Redis, job: str, run_dir: str, ttl_s: float = TTL_S) -> None:
        self.client, self.job, self.ttl_s = client, job, ttl_s
        self.key = JobKeys(job).owner
        self.holder = f"{socket.gethostname()} pid {os.getpid()}, {os.path.abspath(run_dir)} [{uuid.uuid4().hex[:8]}]"
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "JobLease":
        if not self.client.set(self.key, self.holder, px=int(self.ttl_s * 1000), nx=True):
            raise ConfigError(live_job_message(self.client, self.job) or f"job '{self.job}' started twice")
        self._thread = threading.Thread(target=self._keep, name=f"lease-{self.job}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        try:
            self._release(keys=[self.key], args=[self.holder])
        except redis.RedisError:  # Redis gone with the job: the lease expires there anyway
            pass

    def _keep(self) -> None:
        """Renew every third of the TTL; a Redis that restarted empty gets the lease back."""
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self._renew(keys=[self.key], args=[self.holder, int(self.ttl_s * 1000)])
            except redis.RedisError:  # Redis restarting: try again at the next renewal
                pass


def live_job_message(client: redis.Redis, job: str) -> Optional[str]:
    """The line refusing a second job named `job` while one holds the name on `client`'s Redis (None: free)."""
    holder = client.get(JobKeys(job).owner)
    if holder is None:
        return None
    return (f"a job named '{job}' is running on this Redis ({holder.decode(errors='replace')}): its queue and "
            f"status would be reset; give this run another name, or wait for that job to end")
