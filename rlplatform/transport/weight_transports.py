"""How one policy's weights travel from learner rank 0 to its rollout engines: one strategy per
`weights.transport`, picked once per policy by the job's plan (`rlplatform.job.placement`: `auto` made
concrete by `resolved_transport`, then `weight_transport`); nothing else names a transport.

A strategy is a small frozen value that travels to the learner and rollout actors, where it builds its
two ends: the sender on learner rank 0 (`send(weights, version)` returns what the driver hands the
weight store: an object ref, or the version once the weights are already at the engines) and a
receiver in each engine (`newer(version)`: (version, weights) once newer weights arrived).

- object_store: a snapshot put in the Ray object store, its ref held by the `WeightStore`;
- cuda_ipc: the store holds IPC handles of rank 0's packed GPU copy (`cuda_ipc`);
- broadcast: rank 0 sends the weights itself over a process group joining it and every engine
  (`broadcast`), which `connect` opens once before version 0; the version alone reaches the driver.
Either way the driver then announces the version on Redis, which is how workers learn there is news.

With delta sync (`delta_full_every` above 0) what travels is each version's update
(`weight_deltas`): a receiver that took several folds them into one before the engine loads it.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass
from typing import TYPE_CHECKING, ClassVar, List

from rlplatform.config import WeightsConfig

if TYPE_CHECKING:
    import torch

    from rlplatform.transport.transport_ends import GroupEnd, StoreReceiver, StoreSender


@dataclass(frozen=True)
class WeightTransport:
    """The strategy's interface: its two ends, and what the driver does once to join them."""
    name: ClassVar[str]
    _: KW_ONLY
    delta_full_every: int = 0  # with delta sync, a full version every this many (0: every version is full)
    # whether a version travels as a full snapshot in the object store that the evaluator can read as it is
    snapshots_in_store: ClassVar[bool] = False
    moves_bytes: ClassVar[bool] = True  # whether the weights' bytes cross between devices (delta sync saves some)

    def sender(self, device: "torch.device"):
        """Learner rank 0's end on `device`: `send(weights, version)`."""
        raise NotImplementedError

    def receiver(self, weight_store, device: "torch.device"):
        """An engine's end: `newer(version)`; `weight_store` is the policy's `WeightStore` actor (None: none)."""
        raise NotImplementedError

    def connect(self, sender_rank, receivers: List, redis_url: str, version_key: str, timeout_s: float) -> None:
        """Join learner rank 0 (a LearnerActor) and the engines' actors, once, before version 0 (none needed). An
        actor takes part through its `join_weights(...)`, which hands the arguments to its end's `join`."""

    @classmethod
    def from_config(cls, config: WeightsConfig) -> "WeightTransport":
        return cls(delta_full_every=_full_every(config))


@dataclass(frozen=True)
class ObjectStoreTransport(WeightTransport):
    name: ClassVar[str] = "object_store"
    snapshots_in_store: ClassVar[bool] = True

    def sender(self, device: "torch.device") -> "StoreSender":
        from rlplatform.transport.transport_ends import StoreSender
        from rlplatform.transport.weights import to_snapshot

        return StoreSender(to_snapshot)

    def receiver(self, weight_store, device: "torch.device") -> "StoreReceiver":
        from rlplatform.transport.transport_ends import StoreReceiver
        from rlplatform.transport.weights import from_snapshot

        return StoreReceiver(weight_store, from_snapshot)


@dataclass(frozen=True)
class CudaIpcTransport(WeightTransport):
    name: ClassVar[str] = "cuda_ipc"
    moves_bytes: ClassVar[bool] = False  # engines map learner rank 0's GPU copy

    def sender(self, device: "torch.device") -> "StoreSender":
        from rlplatform.transport.cuda_ipc import IpcSender
        from rlplatform.transport.transport_ends import StoreSender

        return StoreSender(IpcSender().handles)

    def receiver(self, weight_store, device: "torch.device") -> "StoreReceiver":
        from rlplatform.transport.cuda_ipc import open_handles
        from rlplatform.transport.transport_ends import StoreReceiver

        return StoreReceiver(weight_store, lambda payload: open_handles(payload, device))


@dataclass(frozen=True)
class BroadcastTransport(WeightTransport):
    name: ClassVar[str] = "broadcast"
    bucket_mb: float = WeightsConfig.bucket_mb  # weights go in buckets of at most this many MB

    def sender(self, device: "torch.device") -> "GroupEnd":
        from rlplatform.transport.transport_ends import GroupEnd

        return GroupEnd(device, self.bucket_bytes)

    def receiver(self, weight_store, device: "torch.device") -> "GroupEnd":
        from rlplatform.transport.transport_ends import GroupEnd

        return GroupEnd(device)

    def connect(self, sender_rank, receivers: List, redis_url: str, version_key: str, timeout_s: float) -> None:
        """Open the group on rank 0's process-group backend (nccl on a GPU, gloo on the CPU); returns once rank 0
        and every receiver joined."""
        from rlplatform.transport.deadlines import deadline_get

        host, port = deadline_get(sender_rank.address.remote(), "learner rank 0", timeout_s)
        backend = deadline_get(sender_rank.placement.remote(), "learner rank 0", timeout_s)["backend"]
        world = 1 + len(receivers)
        joins = [actor.join_weights.remote(host, port, rank, world, backend, redis_url=redis_url,
                                           version_key=version_key)
                 for rank, actor in enumerate([sender_rank, *receivers])]
        deadline_get(joins, "the weight broadcast group's set-up", timeout_s)

    @property
    def bucket_bytes(self) -> int:
        return int(self.bucket_mb * 2 ** 20)

    @classmethod
    def from_config(cls, config: WeightsConfig) -> "BroadcastTransport":
        return cls(config.bucket_mb, delta_full_every=_full_every(config))


TRANSPORTS = {cls.name: cls for cls in (ObjectStoreTransport, BroadcastTransport, CudaIpcTransport)}


def weight_transport(config: WeightsConfig) -> WeightTransport:
    """The strategy `weights.transport` names, with its settings; `auto` is resolved first, for the job's
    cluster (`resolved_transport`, which the job's plan calls)."""
    if config.transport == "auto":
        raise ValueError("weights.transport is auto: resolve it for the cluster first (rlplatform.job.placement)")
    return TRANSPORTS[config.transport].from_config(config)


def resolved_transport(config: WeightsConfig, one_gpu: bool, lora: bool) -> str:
    """`weights.transport` made concrete for a policy: as set, or under auto cuda_ipc where its learner rank and
    rollout engines share `one_gpu` and full weights travel (no LoRA adapters, no deltas), else object_store."""
    if config.transport != "auto":
        return config.transport
    return "cuda_ipc" if one_gpu and not lora and not config.delta else "object_store"


def moves_bytes(transport: str) -> bool:
    """Whether transport `transport` (a concrete name) moves the weights' bytes between devices."""
    return TRANSPORTS[transport].moves_bytes


def _full_every(config: WeightsConfig) -> int:
    return config.delta_full_every if config.delta else 0
