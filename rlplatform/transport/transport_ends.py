"""The two ends a weight transport builds (`rlplatform.transport.weight_transports`): on learner rank 0 the
sender, in each engine the receiver. Through the weight store (object_store, cuda_ipc) a version is a ref the
driver hands the `WeightStore`; over the broadcast group (`GroupEnd`) rank 0 sends the weights itself.

Kept apart from the strategies so that a strategy, a small value inside each rollout actor's spec, can be
unpickled without torch: the evaluator takes its CPU priority before torch loads.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import ray
import torch

from rlplatform.transport.broadcast import BroadcastReceiver, BroadcastSender, open_group
from rlplatform.transport.weight_deltas import combine

Weights = Dict[str, torch.Tensor]


class StoreSender:
    """Rank 0's end of a transport through the weight store: each version put in the object store as
    `pack(weights)` (a snapshot, or IPC handles); the driver hands the ref to the store."""

    def __init__(self, pack) -> None:
        self.pack = pack

    def send(self, weights: Weights, version: int) -> ray.ObjectRef:
        return ray.put(self.pack(weights))


class StoreReceiver:
    """An engine's end of a transport through the weight store: the updates since `version`, `unpack`ed and
    folded into one."""

    def __init__(self, weight_store, unpack) -> None:
        self.weight_store, self.unpack = weight_store, unpack

    def newer(self, version: int) -> Optional[Tuple[int, Weights]]:
        updates = ray.get(self.weight_store.newer_than.remote(version))
        if updates is None:
            return None
        weights = None
        for payload in ray.get([ref for _, (ref,) in updates]):  # fetched together, folded in order
            weights = combine(weights, self.unpack(payload))
        return updates[-1][0], weights


class GroupEnd:
    """Either end of the broadcast group on `device`, open once it joined (`join`, which `BroadcastTransport.connect`
    has every end call through its actor's `join_weights`): rank 0 sends in buckets of `bucket_bytes`."""

    def __init__(self, device: torch.device, bucket_bytes: int = 0) -> None:
        self.device, self.bucket_bytes = device, bucket_bytes
        self.sender: Optional[BroadcastSender] = None
        self.receiver: Optional[BroadcastReceiver] = None

    def join(self, host: str, port: int, rank: int, world: int, backend: str, *, redis_url: str,
             version_key: str) -> None:
        """Join the group at `host:port` as `rank` of `world` (0: the sender); versions are announced on Redis at
        `version_key`."""
        from rlplatform.transport.redis_server import connect

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        group, client = open_group(host, port, rank, world, backend), connect(redis_url)
        if rank == 0:
            self.sender = BroadcastSender(group, client, version_key, self.bucket_bytes)
        else:
            self.receiver = BroadcastReceiver(group, client, version_key, self.device)

    def send(self, weights: Weights, version: int) -> int:
        if self.sender is None:
            raise RuntimeError("weights.transport: broadcast, but the broadcast group was never opened")
        self.sender.send(weights, version)
        return version

    def newer(self, version: int) -> Optional[Tuple[int, Weights]]:
        latest = self.receiver.take() if self.receiver is not None else None
        return latest if latest is not None and latest[0] > version else None
