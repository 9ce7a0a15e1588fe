"""The last hop of a weight sync into vLLM: a weight-transfer engine of ours, registered with vLLM's
`WeightTransferEngineFactory` under `BACKEND`.

The job's weight transports (object store, shared CUDA memory, NCCL broadcast) deliver a version's
tensors to the rollout worker's process, where vLLM's engine core runs (in-process). This engine hands
them to vLLM through its own weight-update lifecycle: `start_weight_update` sets up vLLM's layerwise
reload (parameters vLLM has already processed for its kernels are restored to their loadable form),
`update_weights` runs the model's `load_weights` on the tensors, and `finish_weight_update` processes each
layer again for the kernels. The update info carries the tensors themselves, so nothing is copied or
serialised on the way.

On vLLM's CPU build a mixture of experts needs one step more (`repack_cpu_experts`): its kernel reads each
layer's experts prepacked, and vLLM 0.32 skips that packing when a layer is processed for a weight update,
leaving the new experts in the checkpoint's layout inside the packed tensors.
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
        repack_cpu_experts(self.model)

    def shutdown(self) -> None:
        pass


def repack_cpu_experts(model: torch.nn.Module) -> None:
    """Pack, in place, the experts of each mixture-of-experts layer that vLLM's CPU kernel computes with, after an
    update that reloaded them all (the engine always sends every weight): the reload left them in the checkpoint's
    layout in the tensors the kernel reads. Nothing to do on a GPU, or for a dense model."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts) and not experts._use_zentorch:  # zentorch reads them as loaded
            for name in ("w13_weight", "w2_weight"):
                weight = getattr(layer, name)
                weight.data.copy_(cpu_prepack_moe_weight(weight.data, experts.isa))


def register() -> None:
    """Make `BACKEND` known to vLLM in this process (once)."""
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, TensorsTransferEngine)
    except ValueError:  # registered already: an earlier engine of this process did it
        pass
