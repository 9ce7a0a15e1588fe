"""One live job per name on a Redis, and which run of the name is the newest.

A run's keys are scoped by its name and run id (`rlp:<name>:<run id>:…`, `reward_queue.run_scope`), so a
run touches no other run's keys. Two keys belong to the name itself. The lease `rlp:<name>:owner`: a job
holds it from before it writes any key until it ends, so a same-name job started elsewhere against the
same Redis (another run directory, another machine) refuses to start in one line. It names its holder
(host, pid, run directory) and expires `ttl_s` after its last renewal, renewed by a daemon thread, so a job
killed outright frees its name within `ttl_s`, at once to a job started on the same machine (the holder's process
is gone). And `rlp:<name>:run`, the run id of the name's newest run,
set by the lease's holder: where standalone workers and `rlp status`, given only the name, find the run.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import uuid
from typing import Optional

import psutil
import redis

from rlplatform.config import ConfigError
from rlplatform.transport.keys import NameKeys, run_scope

TTL_S = 30.0

# KEYS: the lease, the newest-run key. ARGV: holder, TTL in ms, run id. Renews the lease while this holder
# still holds it; takes it back, with its run the newest, when it is free (a Redis that restarted empty).
_RENEW = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end
if redis.call('set', KEYS[1], ARGV[1], 'px', ARGV[2], 'nx') then
  redis.call('set', KEYS[2], ARGV[3])
  return 1
end
return 0
"""
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
# KEYS: the lease. ARGV: the holder found, the new holder, TTL in ms. Takes the lease over from that holder.
_TAKE_OVER = """
if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('set', KEYS[1], ARGV[2], 'px', ARGV[3]) end
return 0
"""
HOLDER = re.compile(r"(?P<host>\S+) pid (?P<pid>\d+), ")  # how a holder starts: its host and process


class JobLease:
    """`with JobLease(client, job, run_id, run_dir):` holds job `job`'s name on `client`'s Redis, its run
    `run_id` the name's newest."""

    def __init__(self, client: redis.Redis, job: str, run_id: str, run_dir: str, ttl_s: float = TTL_S) -> None:
        self.client, self.job, self.run_id, self.ttl_s = client, job, run_id, ttl_s
        self.key = NameKeys(job).owner
        self.holder = f"{socket.gethostname()} pid {os.getpid()}, {os.path.abspath(run_dir)} [{uuid.uuid4().hex[:8]}]"
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self._take = client.register_script(_TAKE_OVER)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "JobLease":
        if not self.client.set(self.key, self.holder, px=int(self.ttl_s * 1000), nx=True) and not self._take_over():
            raise ConfigError(live_job_message(self.client, self.job) or f"job '{self.job}' started twice")
        self.client.set(NameKeys(self.job).newest_run, self.run_id)
        self._thread = threading.Thread(target=self._keep, name=f"lease-{self.job}", daemon=True)
        self._thread.start()
        return self

    def _take_over(self) -> bool:
        """Takes the lease from a holder on this machine whose process is gone (a job that could not give it back:
        killed, or its Redis unreachable as it ended) instead of waiting out its TTL; False where the holder may
        live."""
        found = self.client.get(self.key)
        if found is None or not gone(found):
            return False
        return bool(self._take(keys=[self.key], args=[found, self.holder, int(self.ttl_s * 1000)]))

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
                self._renew(keys=[self.key, NameKeys(self.job).newest_run],
                            args=[self.holder, int(self.ttl_s * 1000), self.run_id])
            except redis.RedisError:  # Redis restarting: try again at the next renewal
                pass


def newest_run(client: redis.Redis, job: str) -> Optional[str]:
    """The `run_scope` of the newest run named `job` on `client`'s Redis (None: no run of the name started there)."""
    run_id = client.get(NameKeys(job).newest_run)
    return run_scope(job, run_id.decode()) if run_id is not None else None


def gone(holder: bytes) -> bool:
    """Whether a lease's holder is a process of this machine that no longer runs (its lease is free to take)."""
    found = HOLDER.match(holder.decode(errors="replace"))
    return bool(found and found["host"] == socket.gethostname() and not psutil.pid_exists(int(found["pid"])))


def live_job_message(client: redis.Redis, job: str) -> Optional[str]:
    """The line refusing a second job named `job` while one holds the name on `client`'s Redis (None: free, or held
    by a process of this machine that is gone)."""
    holder = client.get(NameKeys(job).owner)
    if holder is None or gone(holder):
        return None
    return (f"a job named '{job}' is running on this Redis ({holder.decode(errors='replace')}): one job of a name "
            f"runs at a time (standalone workers and `rlp status` find a job by its name); give this run another "
            f"name, or wait for that job to end")
