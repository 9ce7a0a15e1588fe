"""Reward workers under failure: a worker killed mid-batch loses no sample, requests delivered
too often go to dead letters, producers wait on a full queue, and `rediss://` URLs work through TLS (a standalone
`rlp reward-worker` serving a running job: tests/test_end_to_end.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import subprocess
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from rlplatform.config import RewardSpec, RewardWorkersConfig
from rlplatform.rewards.worker import RewardWorker, job_rewards_json
from rlplatform.transport.redis_server import connect
from rlplatform.transport.keys import NameKeys, run_scope
from rlplatform.transport.reward_queue import GROUP, RewardQueue
from rlplatform.transport.samples import Sample
from tests.processes import RLP
from tests.transport.queue_events import scripts_run, wait_for_refusals, wait_until_idle



def make_samples(count: int, prefix: str = "s"):
    return [Sample(f"{prefix}{i}/0", f"{prefix}{i}", "policy", f"{i}+0=", str(i), prompt_ids=[1], completion_ids=[2],
                   behaviour_logprobs=[-0.5], token_versions=[0],
                   row={"answer": str(i)}) for i in range(count)]


def collect(queue: RewardQueue, into: list) -> None:
    into += queue.read_results(block_ms=20)


@pytest.fixture
def job(redis_client):
    """A run's scope `<name>:r1`, registered as its name's newest run (as a job's lease does), so a standalone
    `rlp reward-worker --job <name>` finds it."""
    name = f"rel-{uuid.uuid4().hex[:8]}"
    redis_client.set(NameKeys(name).newest_run, "r1")
    return run_scope(name, "r1")


@pytest.fixture
def slow_reward_module(tmp_path):
    (tmp_path / "slow_rewards_mod.py").write_text(textwrap.dedent("""
        import time
        def slow(sample):
            time.sleep(0.02)
            return float(sample.completion == sample.answer)
    """))
    return tmp_path


def test_worker_killed_mid_batch_loses_no_sample(redis_server, redis_client, job, slow_reward_module, monkeypatch):
    queue = RewardQueue(redis_client, job)
    queue.create_group()
    queue.publish_rewards(job_rewards_json([RewardSpec(fn="slow_rewards_mod:slow")], []))
    queue.submit(make_samples(200))
    env = dict(os.environ, PYTHONPATH=str(slow_reward_module))
    victim = subprocess.Popen([RLP, "reward-worker", "--redis", redis_server, "--job", job.split(":")[0],
                               "--concurrency", "1",
                               "--batch-size", "50", "--name", "victim"], env=env, stderr=subprocess.PIPE)
    results: list = []
    deadline = time.monotonic() + 60
    while len(results) < 50 and time.monotonic() < deadline:  # its first batch is stored...
        collect(queue, results)
    while not redis_client.xpending(queue.keys.requests, GROUP)["pending"] and time.monotonic() < deadline:
        time.sleep(0.01)  # ...and it holds the next one
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    held = redis_client.xpending(queue.keys.requests, GROUP)["pending"]
    assert held > 0 and len(results) < 200, "the worker must die holding unfinished requests"

    monkeypatch.syspath_prepend(str(slow_reward_module))
    survivor = RewardWorker("survivor", [RewardSpec(fn="slow_rewards_mod:slow")], redis_server, job,
                            RewardWorkersConfig(batch_size=64, concurrency=8, claim_idle_s=0.5))
    while len(results) < 200 and time.monotonic() < deadline + 60:
        survivor.step(block_ms=50)
        collect(queue, results)
    collect(queue, results)
    ids = [r.sample_id for r in results]
    assert sorted(ids) == sorted(s.sample_id for s in make_samples(200))  # every sample exactly once
    assert survivor.stats.reclaimed >= 1
    assert all(r.reward == 1.0 and r.error is None for r in results)
    assert queue.pending() == 0 and redis_client.xpending(queue.keys.requests, GROUP)["pending"] == 0


def test_request_delivered_too_often_goes_to_dead_letters(redis_server, redis_client, job):
    queue = RewardQueue(redis_client, job)
    queue.create_group()
    queue.submit(make_samples(1))
    assert len(queue.fetch("ghost-1", 10, 10)) == 1  # delivered once, its worker dies
    wait_until_idle(redis_client, queue.keys.requests, GROUP, 10)
    assert [t[2] for t in queue.reclaim("ghost-2", 10, 10)] == [1]  # delivered twice, dies again
    wait_until_idle(redis_client, queue.keys.requests, GROUP, 10)
    worker = RewardWorker("survivor", [RewardSpec(name="exact_match")], redis_server, job,
                          RewardWorkersConfig(claim_idle_s=0.01, max_deliveries=2))
    worker.step(block_ms=10)
    (msg_id, fields), = redis_client.xrange(queue.keys.dead)
    assert fields[b"reason"] == b"delivered 2 times without a stored result"
    assert queue.read_results(block_ms=10) == [] and queue.pending() == 0


def test_producer_waits_on_a_full_queue_and_loses_nothing(redis_server, redis_client, job):
    queue = RewardQueue(redis_client, job, max_pending=5)
    queue.create_group()
    queue.submit(make_samples(5, "a"))
    producer = threading.Thread(target=queue.submit, args=(make_samples(3, "b"),))
    since = scripts_run(redis_client)
    producer.start()
    wait_for_refusals(redis_client, producer, since)
    assert producer.is_alive() and queue.pending() == 5  # waiting, not dropping
    worker = RewardWorker("w", [RewardSpec(name="exact_match")], redis_server, job, RewardWorkersConfig(batch_size=2))
    results: list = []
    deadline = time.monotonic() + 30
    while len(results) < 8 and time.monotonic() < deadline:
        worker.step(block_ms=20)
        collect(queue, results)
    producer.join(timeout=5)
    assert not producer.is_alive()
    assert sorted(r.sample_id for r in results) == sorted(
        s.sample_id for s in make_samples(5, "a") + make_samples(3, "b"))


def _self_signed(tmp_path: Path) -> tuple:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


class TLSProxy:
    """TLS on 127.0.0.1 in front of the plain test Redis: the client side speaks real TLS."""

    def __init__(self, target_port: int, cert: Path, key: Path) -> None:
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(cert, key)
        self.target_port = target_port
        self.loop = asyncio.new_event_loop()
        self.port = None
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.context))
        self.port = server.sockets[0].getsockname()[1]
        ready.set()
        self.loop.run_forever()

    async def _handle(self, client_reader, client_writer) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(source, sink):
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
            sink.close()
        await asyncio.gather(pipe(client_reader, writer), pipe(reader, client_writer), return_exceptions=True)


@pytest.mark.skipif(not any(os.access(os.path.join(p, "openssl"), os.X_OK)
                            for p in os.environ.get("PATH", "").split(os.pathsep)), reason="needs openssl")
def test_rediss_url_round_trip_through_tls(redis_server, tmp_path, job):
    cert, key = _self_signed(tmp_path)
    plain_port = int(redis_server.rsplit(":", 1)[1].split("/")[0])
    proxy = TLSProxy(plain_port, cert, key)
    password = redis_server.split("://:", 1)[1].split("@", 1)[0]
    url = f"rediss://:{password}@127.0.0.1:{proxy.port}/0?ssl_ca_certs={cert}&ssl_cert_reqs=required"
    client = connect(url)
    assert client.connection_pool.connection_class.__name__ == "SSLConnection"
    queue = RewardQueue(client, job)
    queue.create_group()
    queue.submit(make_samples(3))
    worker = RewardWorker("tls", [RewardSpec(name="exact_match")], url, job)
    worker.step(block_ms=50)
    results = queue.read_results(block_ms=50)
    assert sorted(r.sample_id for r in results) == ["s0/0", "s1/0", "s2/0"]
    with pytest.raises(ConnectionError, match="cannot reach Redis"):
        connect(f"rediss://:{password}@127.0.0.1:{proxy.port}/0?ssl_cert_reqs=required")  # unknown CA: refused
