"""CUDA IPC weight handles, for learner rank 0 and rollout workers that share one GPU.

Rank 0 packs each version into one GPU buffer of its own (the newest `KEEP_VERSIONS` stay alive) and
publishes that buffer's IPC handle and the packing plan, a few KB, through the weight store; a rollout
worker maps the buffer and copies the weights straight into its engine, never through host memory.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict
from typing import Dict

import torch
from torch.multiprocessing.reductions import reduce_tensor

from rlplatform.transport.broadcast import Entry, pack, plan_buckets, unpack
from rlplatform.transport.weights import unique_weights

KEEP_VERSIONS = 2  # a worker may still be mapping the previous version while the next is published
DEVICE_ARG = 6  # position of the device index in the arguments of torch's rebuild_cuda_tensor


class IpcSender:
    """Learner rank 0's end: the IPC handle of a private packed GPU copy of each version."""

    def __init__(self) -> None:
        self._kept: deque = deque(maxlen=KEEP_VERSIONS)

    def handles(self, state_dict: Dict[str, torch.Tensor]) -> Dict:
        weights = {name: t.detach().contiguous() for name, t in unique_weights(state_dict).items()}
        device = next(iter(weights.values())).device
        if device.type != "cuda":
            raise RuntimeError("weights.transport: cuda_ipc needs learner rank 0 on a GPU; it runs on "
                               f"{device}; use weights.transport: object_store or broadcast")
        entries = plan_buckets(weights, bucket_bytes=2 ** 62)  # one bucket
        buffer = pack(weights, entries, 0)
        torch.cuda.synchronize(device)
        self._kept.append(buffer)
        return {"gpu": _uuid(device), "entries": [asdict(e) for e in entries], "buffer": reduce_tensor(buffer)}


def open_handles(message: Dict, device: torch.device) -> Dict[str, torch.Tensor]:
    """The weights behind `IpcSender.handles`, mapped on `device` (the same physical GPU)."""
    if device.type != "cuda" or _uuid(device) != message["gpu"]:
        raise RuntimeError(f"weights.transport: cuda_ipc needs each rollout worker on learner rank 0's GPU, but "
                           f"this worker runs on {device}; give both the same GPU (fractional num_gpus on one-GPU "
                           f"nodes) or use weights.transport: broadcast")
    rebuild, args = message["buffer"]
    args = list(args)
    args[DEVICE_ARG] = device.index or 0  # the index this process sees the GPU under
    return unpack(rebuild(*args), [Entry(**e) for e in message["entries"]], 0)


def _uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)
