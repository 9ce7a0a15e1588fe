"""The embedded redis-server and its clients: no password on the command line, an append-only
file that survives SIGKILL so a restart on the same port carries a producer/consumer pair on,
and one `RedisUnavailable` line, password hidden, when the server does not come back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import psutil
import pytest

from rlplatform.config import RewardSpec, RewardWorkersConfig
from rlplatform.rewards.worker import RewardWorker
from rlplatform.transport.redis_server import (PID_FILE, EmbeddedRedis, RedisUnavailable, connect, redis_binary,
                                               stop_leftover)
from rlplatform.transport.reward_queue import GROUP, RewardQueue
from rlplatform.transport.run_keys import start_run
from rlplatform.transport.samples import Sample


def make_samples(count: int, group: str) -> list:
    return [Sample(sample_id=f"{group}/{i}", group_id=group, policy="policy", prompt="1+1=", completion="2",
                   prompt_ids=[1, 2], completion_ids=[3], behaviour_logprobs=[-0.5], token_versions=[0],
                   row={"prompt": "1+1=", "answer": "2"}) for i in range(count)]


@pytest.fixture
def server(tmp_path):
    embedded = EmbeddedRedis(str(tmp_path / "redis")).start()
    yield embedded
    embedded.stop()


def test_password_is_not_on_the_command_line_and_the_data_folder_is_private(server):
    with open(f"/proc/{server.pid}/cmdline", "rb") as f:
        cmdline = f.read()
    assert server.password.encode() not in cmdline and b"redis-server" in cmdline
    # redis-server rewrites its title once up, so the argv it was started with is checked too
    assert not any(server.password in arg for arg in server._process.args)
    assert connect(server.url).ping()
    assert os.stat(server.data_dir).st_mode & 0o777 == 0o700
    assert os.path.isfile(os.path.join(server.data_dir, "appendonly.aof"))


def collect_until(queue: RewardQueue, worker: RewardWorker, expected: int, timeout_s: float = 60) -> list:
    results: list = []
    deadline = time.monotonic() + timeout_s
    while len(results) < expected and time.monotonic() < deadline:
        worker.step(block_ms=20)
        results += queue.read_results(block_ms=20)
    return results


def test_a_killed_server_restarted_on_its_port_loses_no_acknowledged_result(server):
    job = f"aof-{uuid.uuid4().hex[:6]}"
    queue = RewardQueue(connect(server.url), job, max_pending=100)
    start_run(queue.client, queue.keys.run, queue.bound())
    queue.create_group()
    worker = RewardWorker("w", [RewardSpec(name="exact_match")], server.url, job, RewardWorkersConfig(batch_size=8))
    queue.submit(make_samples(6, "before"))
    assert worker.step(block_ms=50) == 6  # scored, stored and acknowledged before the crash
    queue.submit(make_samples(4, "pending"))  # submitted, not yet scored

    os.kill(server.pid, signal.SIGKILL)
    restart = threading.Timer(1.0, server.start)
    restart.start()
    queue.submit(make_samples(5, "after"))  # reconnects once the server is back
    restart.join()

    assert queue.client.xinfo_groups(queue.keys.requests)[0]["name"].decode() == GROUP
    results = collect_until(queue, worker, 15)
    assert sorted(r.sample_id for r in results) == sorted(
        s.sample_id for s in make_samples(6, "before") + make_samples(4, "pending") + make_samples(5, "after"))
    assert queue.pending() == 0


def test_a_worker_restarting_while_the_server_restarts_waits_for_it(server):
    os.kill(server.pid, signal.SIGKILL)
    restart = threading.Timer(1.0, server.start)
    restart.start()
    start = time.monotonic()
    with pytest.raises(RedisUnavailable, match="cannot reach Redis"):
        connect(server.url)  # a job's start does not wait
    assert time.monotonic() - start < 0.9
    # a reward worker (restarted by Ray) constructed during the outage connects once the server is back
    worker = RewardWorker("w", [RewardSpec(name="exact_match")], server.url, f"wait-{uuid.uuid4().hex[:6]}")
    assert time.monotonic() - start >= 1.0 and worker.queue.client.ping()
    restart.join()


def test_a_server_that_does_not_come_back_is_one_line_within_the_timeout(server):
    queue = RewardQueue(connect(server.url, reconnect_s=2), f"gone-{uuid.uuid4().hex[:6]}", max_pending=10)
    queue.create_group()
    os.kill(server.pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RedisUnavailable) as raised:
        queue.submit(make_samples(1, "lost"))
    assert 1.5 < time.monotonic() - start < 6
    message = str(raised.value)
    assert message.startswith(f"the job's Redis at redis://127.0.0.1:{server.port} (password hidden) went away: ")
    assert "\n" not in message and server.password not in message
    assert raised.value.__suppress_context__  # printed alone, not as a chain of tracebacks
    start = time.monotonic()
    with pytest.raises(RedisUnavailable):  # given up: later calls fail at once, with the same line
        queue.pending()
    assert time.monotonic() - start < 0.5


OWNER = """
import sys, time
from rlplatform.transport.redis_server import EmbeddedRedis
server = EmbeddedRedis(sys.argv[1]).start()
print(server.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return True
        time.sleep(0.05)
    return False


def test_a_sigkilled_owner_takes_its_embedded_server_with_it(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", OWNER, str(tmp_path / "redis")], stdout=subprocess.PIPE, text=True)
    server = int(owner.stdout.readline())
    assert psutil.Process(server).is_running()
    owner.kill()  # SIGKILL: no cleanup runs in the owner
    owner.wait()
    assert _gone(server, 10.0), "the embedded redis-server outlived the process that started it"


def test_a_server_left_in_the_data_directory_is_stopped_before_a_new_one_starts(tmp_path):
    data = tmp_path / "redis"
    data.mkdir()
    pid_file = data / PID_FILE
    leftover = subprocess.Popen([redis_binary(), "--port", "0", "--unixsocket", str(data / "left.sock"), "--save", "",
                                 "--dir", str(data),
                                 "--pidfile", str(pid_file)], stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not pid_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pid_file.exists()
        with EmbeddedRedis(str(data)) as server:  # as a resumed job's server on the same run directory
            assert leftover.wait(timeout=10) is not None
            assert connect(server.url).ping()
    finally:
        if leftover.poll() is None:
            leftover.kill()
    assert not stop_leftover(str(tmp_path / "missing.pid"))
