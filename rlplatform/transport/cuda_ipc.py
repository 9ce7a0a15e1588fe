"""CUDA IPC weight handles, for learner rank 0 and rollout workers that share one GPU.

Rank 0 copies each version into GPU buffers of its own (the newest `KEEP_VERSIONS` stay alive) and
publishes their IPC handles, a few KB, through the weight store; a rollout worker maps the buffers
and copies the weights straight into its engine, with no trip through host memory.
"""

from __future__ import annotations

from collections import deque
from typing import Dict

import torch
from torch.multiprocessing.reductions import reduce_tensor

from rlplatform.transport.broadcast import unique_weights

KEEP_VERSIONS = 2  # a worker may still be mapping the previous version while the next is published
DEVICE_ARG = 6  # position of the device index in the arguments of torch's rebuild_cuda_tensor


class IpcPublisher:
    """Learner rank 0's end: IPC handles of a private GPU copy of each version."""

    def __init__(self) -> None:
        self._kept: deque = deque(maxlen=KEEP_VERSIONS)

    def handles(self, state_dict: Dict[str, torch.Tensor]) -> Dict:
        copies = {name: t.detach().clone() for name, t in unique_weights(state_dict).items()}
        device = next(iter(copies.values())).device
        if device.type != "cuda":
            raise RuntimeError("weights.transport: cuda_ipc needs learner rank 0 on a GPU; it runs on "
                               f"{device}; use weights.transport: object_store or broadcast")
        torch.cuda.synchronize(device)
        self._kept.append(copies)
        return {"gpu": _uuid(device), "weights": {name: reduce_tensor(t) for name, t in copies.items()}}


def open_handles(message: Dict, device: torch.device) -> Dict[str, torch.Tensor]:
    """The weights behind `IpcPublisher.handles`, mapped on `device` (the same physical GPU)."""
    if device.type != "cuda" or _uuid(device) != message["gpu"]:
        raise RuntimeError(f"weights.transport: cuda_ipc needs each rollout worker on learner rank 0's GPU, but "
                           f"this worker runs on {device}; give both the same GPU (fractional num_gpus on one-GPU "
                           f"nodes) or use weights.transport: broadcast")
    weights = {}
    for name, (rebuild, args) in message["weights"].items():
        args = list(args)
        args[DEVICE_ARG] = device.index or 0  # the index this process sees the GPU under
        weights[name] = rebuild(*args)
    return weights


def _uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)
