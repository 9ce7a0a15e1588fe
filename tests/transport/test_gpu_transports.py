"""GPU weight transports (`gpu` marker): CUDA IPC between two processes on one GPU, and the broadcast
over NCCL, which needs one GPU per rank (NCCL refuses two ranks on one device)."""

from __future__ import annotations

import socket
import time

import pytest
import ray
import torch

from rlplatform.transport.weight_transports import BroadcastTransport, CudaIpcTransport


def _weights():
    generator = torch.Generator().manual_seed(0)
    return {"embed.weight": torch.randn(300, 64, generator=generator).bfloat16(),
            "norm.weight": torch.randn(64, generator=generator), "step": torch.arange(5)}


@ray.remote(num_cpus=0, num_gpus=0.4)
class Side:
    """One process on the shared GPU: publishes or receives a version of `_weights()`."""

    def publish_ipc(self):
        self.sender = CudaIpcTransport().sender(torch.device("cuda", 0))  # kept: its GPU buffers must outlive the reader's copy
        return self.sender.send({k: v.cuda() for k, v in _weights().items()}, 3)

    def read_ipc(self, store):
        version, weights = CudaIpcTransport().receiver(store, torch.device("cuda", 0)).newer(-1)
        return version, {k: v.clone().cpu() for k, v in weights.items()}

    def address(self):
        with socket.socket() as sock:
            sock.bind(("", 0))
            return ray.util.get_node_ip_address(), sock.getsockname()[1]

    def open_sender(self, host, port, world, redis_url, version_key):
        self.sender = BroadcastTransport(bucket_mb=4096 / 2 ** 20).sender(torch.device("cuda", 0))
        self.sender.join(host, port, 0, world, "nccl", redis_url=redis_url, version_key=version_key)

    def send(self, version):
        self.sender.send({k: v.cuda() for k, v in _weights().items()}, version)

    def open_receiver(self, host, port, rank, world, redis_url, version_key):
        self.receiver = BroadcastTransport().receiver(None, torch.device("cuda", 0))
        self.receiver.join(host, port, rank, world, "nccl", redis_url=redis_url, version_key=version_key)

    def take(self):
        taken = self.receiver.receiver.take()
        return None if taken is None else (taken[0], {k: v.cpu() for k, v in taken[1].items()})


@pytest.mark.gpu
def test_cuda_ipc_hands_a_version_to_another_process_on_the_same_gpu(ray_session):
    from rlplatform.transport.weight_store import WeightStoreActor

    learner, worker, store = Side.remote(), Side.remote(), WeightStoreActor.remote()
    ray.get(store.publish.remote(3, [ray.get(learner.publish_ipc.remote())]))
    version, weights = ray.get(worker.read_ipc.remote(store))
    assert version == 3 and all(torch.equal(weights[k], v) for k, v in _weights().items())


@pytest.mark.gpu
def test_nccl_broadcast_delivers_exact_weights_in_buckets(ray_session, redis_server):
    if torch.cuda.device_count() < 2:
        pytest.skip("an NCCL broadcast needs a GPU per rank")
    learner, worker = Side.options(num_gpus=1).remote(), Side.options(num_gpus=1).remote()
    key = f"nccl-test-{time.time_ns()}:version"
    host, port = ray.get(learner.address.remote())
    ray.get([learner.open_sender.remote(host, port, 2, redis_server, key),
             worker.open_receiver.remote(host, port, 1, 2, redis_server, key)])
    ray.get(learner.send.remote(7))
    deadline = time.time() + 30
    while (latest := ray.get(worker.take.remote())) is None and time.time() < deadline:
        time.sleep(0.05)
    assert latest[0] == 7 and all(torch.equal(latest[1][k], v) for k, v in _weights().items())
