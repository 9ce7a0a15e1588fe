"""The last hop of a weight sync into vLLM: a weight-transfer engine of ours, registered with vLLM's
`WeightTransferEngineFactory` under `BACKEND`.

The job's weight transports (object store, shared CUDA memory, NCCL broadcast) deliver a version's
tensors to the rollout worker's process, where vLLM's engine core runs (in-process). This engine hands
them to vLLM through its own weight-update lifecycle: `start_weight_update` sets up vLLM's layerwise
reload (parameters vLLM has already processed for its kernels are restored to their loadable form),
`update_weights` runs the model's `load_weights` on the tensors, and `finish_weight_update` processes each
layer again for the kernels. The update info carries the tensors themselves, so nothing is copied or
serialised on the way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch
from vllm.distributed.weight_transfer import WeightTransferEngine, WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import WeightTransferInitInfo, WeightTransferUpdateInfo
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

BACKEND = "rlplatform_tensors"  # the `weight_transfer_config.backend` a VLLMEngine starts vLLM with


@dataclass
class TensorsInit(WeightTransferInitInfo):
    """Nothing to rendezvous: the tensors are already in this process."""


@dataclass
class TensorsUpdate(WeightTransferUpdateInfo):
    weights: List[Tuple[str, torch.Tensor]]  # (Hugging Face name, tensor) pairs, on the engine's device


class TensorsTransferEngine(WeightTransferEngine[TensorsInit, TensorsUpdate]):
    """Loads (name, tensor) pairs handed over in this process into vLLM's model."""

    init_info_cls = TensorsInit
    update_info_cls = TensorsUpdate

    def init_transfer_engine(self, init_info: TensorsInit) -> None:
        pass

    def start_weight_update(self) -> None:
        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: TensorsUpdate) -> None:
        self.model.load_weights(update_info.weights)

    def finish_weight_update(self) -> None:
        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        pass


def register() -> None:
    """Make `BACKEND` known to vLLM in this process (once)."""
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, TensorsTransferEngine)
    except ValueError:  # registered already: an earlier engine of this process did it
        pass
