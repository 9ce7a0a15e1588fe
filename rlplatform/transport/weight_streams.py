"""Weight streams, one per `weights.transport`: what learner rank 0 publishes for a version and how a
rollout worker picks up the newest one.

object_store: a snapshot put in the Ray object store, its ref held by the `WeightStore`; cuda_ipc: the
same store holds IPC handles of rank 0's GPU copy (`cuda_ipc`); broadcast: rank 0 sends the weights
itself over a process group (`broadcast`) and the version alone reaches the driver. Either way the
driver then mirrors the version on Redis, which is how workers learn there is news.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import ray
import torch

from rlplatform.transport.broadcast import BroadcastReceiver, BroadcastSender, open_group
from rlplatform.transport.cuda_ipc import IpcPublisher, open_handles
from rlplatform.transport.weights import from_snapshot, to_snapshot

Weights = Dict[str, torch.Tensor]


class Publisher:
    """Learner rank 0's end. `publish` returns what the driver hands the weight store: an object ref
    (object_store, cuda_ipc), or the version already broadcast."""

    def __init__(self, transport: str) -> None:
        self.transport = transport
        self.sender: Optional[BroadcastSender] = None  # set by `open_broadcast` before the first version
        self._ipc = IpcPublisher() if transport == "cuda_ipc" else None

    def publish(self, state_dict: Weights, version: int):
        if self.transport == "broadcast":
            if self.sender is None:
                raise RuntimeError("weights.transport: broadcast, but the broadcast group was never opened")
            self.sender.send(state_dict, version)
            return version
        if self.transport == "cuda_ipc":
            return ray.put(self._ipc.handles(state_dict))
        return ray.put(to_snapshot(state_dict))


class Subscriber:
    """A rollout worker's end: `newer(version)` is (version, weights) when newer weights arrived."""

    def __init__(self, transport: str, weight_store, device: torch.device) -> None:
        self.transport, self.weight_store, self.device = transport, weight_store, device
        self.receiver: Optional[BroadcastReceiver] = None  # set by `open_broadcast`

    def newer(self, version: int) -> Optional[Tuple[int, Weights]]:
        if self.transport == "broadcast":
            latest = self.receiver.take() if self.receiver is not None else None
            return latest if latest is not None and latest[0] > version else None
        newer = ray.get(self.weight_store.newer_than.remote(version))
        if newer is None:
            return None
        version, (ref,) = newer
        payload = ray.get(ref)
        return version, open_handles(payload, self.device) if self.transport == "cuda_ipc" else from_snapshot(payload)


def open_broadcast(sender_rank, receivers: List, redis_url: str, version_key: str, bucket_mb: float,
                   timeout_s: float) -> None:
    """Join learner rank 0 (`sender_rank`, a LearnerActor) and every rollout actor in one group, on the
    backend of rank 0's device; returns once all have joined."""
    from rlplatform.transport.deadlines import deadline_get

    host, port = deadline_get(sender_rank.address.remote(), "learner rank 0", timeout_s)
    backend = deadline_get(sender_rank.broadcast_backend.remote(), "learner rank 0", timeout_s)
    world = 1 + len(receivers)
    joins = [sender_rank.open_broadcast.remote(host, port, world, backend, redis_url, version_key,
                                               int(bucket_mb * 2 ** 20))]
    joins += [actor.open_broadcast.remote(host, port, rank, world, backend) for rank, actor in
              enumerate(receivers, start=1)]
    deadline_get(joins, "the weight broadcast group's set-up", timeout_s)


def sender(host: str, port: int, world: int, backend: str, client, version_key: str,
           bucket_bytes: int) -> BroadcastSender:
    return BroadcastSender(open_group(host, port, 0, world, backend), client, version_key, bucket_bytes)


def receiver(host: str, port: int, rank: int, world: int, backend: str, client, version_key: str,
             device: torch.device) -> BroadcastReceiver:
    return BroadcastReceiver(open_group(host, port, rank, world, backend), client, version_key, device)
