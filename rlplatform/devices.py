"""Where an actor computes, and in what precision.

The controller asks Ray for `gpus_per_actor` GPUs per learner rank and rollout worker (where a whole
GPU each does not fit the cluster, `gpu_shares` splits the GPUs among the actors whose share is unset);
inside the actor, `resolve_device` turns `device: auto|cpu|cuda` into a torch device on the machine it
runs on, using the GPU Ray assigned to it. `torch_dtype` maps `model.dtype` to the torch dtype.
"""

from __future__ import annotations

import math
import os
from typing import Optional, Tuple

import ray
import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a `model.dtype` name."""
    return DTYPES[name]


def gpus_per_actor(device: str, num_gpus: Optional[float], cluster_gpus: float) -> float:
    """GPUs to reserve per actor: `num_gpus` when set, else one on cuda, none on cpu, and under
    auto one when the Ray cluster has GPUs."""
    if num_gpus is not None:
        return num_gpus
    if device == "auto":
        return 1.0 if cluster_gpus > 0 else 0.0
    return 1.0 if device == "cuda" else 0.0


def gpu_shares(cluster_gpus: float, reserved: float, ranks: int, rollout_actors: int,
               ranks_may_share: bool) -> Tuple[float, float]:
    """(GPUs per learner rank, GPUs per rollout worker or evaluator) for the `ranks` and `rollout_actors` on GPUs
    whose `num_gpus` is unset, beside the `reserved` GPUs the others' settings take: a whole GPU each where that
    fits the cluster; else the ranks keep whole GPUs and the rollout side shares the whole GPUs left, as few to a
    GPU as fit; else one GPU (or, on a one-GPU cluster, what the settings leave of it) is shared: half for the
    ranks, half for the rollout side, where the learners may share (NCCL needs a whole GPU per rank of several).
    Where nothing fits, a whole GPU each: the cluster check then names the keys to set."""
    free = cluster_gpus - reserved
    whole = int(free + 1e-9)
    if ranks + rollout_actors <= whole:
        return 1.0, 1.0
    left = whole - ranks
    if left >= 1 and rollout_actors:
        return 1.0, _gpu_fraction(1 / math.ceil(rollout_actors / left))
    room = 1.0 if whole >= 1 else free if cluster_gpus == 1 else 0.0  # one GPU: whole, or what is free of it
    if room <= 0 or (ranks and not ranks_may_share):
        return 1.0, 1.0
    if not rollout_actors:
        return _gpu_fraction(room / ranks), 1.0
    if not ranks:
        return 1.0, _gpu_fraction(room / rollout_actors)
    return _gpu_fraction(room / 2 / ranks), _gpu_fraction(room / 2 / rollout_actors)


def _gpu_fraction(share: float) -> float:
    """`share` rounded down to the 1e-4 steps Ray counts GPU fractions in: shares of one GPU sum to at most 1."""
    return math.floor(share * 10_000 + 1e-6) / 10_000  # 1e-6: 0.6 / 3 is 0.2, not 0.1999


def vllm_memory_fraction(gpu_memory_utilization: Optional[float], num_gpus: Optional[float]) -> float:
    """The share of its GPU's memory a vLLM engine takes: `rollout.gpu_memory_utilization` where set, else 0.9 of
    the worker's share of the GPU (`rollout.num_gpus`; unset, a whole GPU), as vLLM takes 0.9 of a GPU of its own."""
    if gpu_memory_utilization is not None:
        return gpu_memory_utilization
    return round(0.9 * min(1.0, num_gpus or 1.0), 4)


def resolve_dtype(dtype: str, learner_gpus: float) -> str:
    """`model.dtype` as a concrete dtype: `auto` is bfloat16 when the learner ranks reserve GPUs, else float32."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if learner_gpus > 0 else "float32"


def resolve_device(device: str) -> torch.device:
    """The torch device an actor computes on. `auto` is the GPU Ray assigned to this actor (outside
    a Ray actor: any visible GPU), else the CPU; `cuda` without a visible GPU is an error."""
    gpu = assigned_gpu()
    if device == "cpu" or (device == "auto" and not _gpu_here(gpu)):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(f"device 'cuda' was asked for but this process sees no CUDA device (torch "
                           f"{torch.__version__}, CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); "
                           f"install a CUDA build of torch, or set learner.device / rollout.device to cpu or auto")
    return torch.device("cuda", gpu or 0)


def share_kv_heads_on_cpu(device: torch.device) -> None:
    """On CPU, have transformers' SDPA attention read grouped key/value heads in place (`enable_gqa`) even
    under an attention mask, rather than copy each one per query head (`repeat_kv`): the same numbers, about 5%
    less learner step time on the demo model. On CUDA transformers keeps its own rule (a masked grouped call
    would leave the flash kernels for the math one). Process-wide: the `sdpa` attention function transformers
    looks up at each call is replaced by `sdpa_sharing_kv_heads_on_cpu`."""
    from transformers import AttentionInterface

    if device.type == "cpu":
        AttentionInterface.register("sdpa", sdpa_sharing_kv_heads_on_cpu)


def sdpa_sharing_kv_heads_on_cpu(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                                 scaling: Optional[float] = None, is_causal: Optional[bool] = None, **kwargs):
    """transformers' SDPA attention (its signature and output layout), with grouped key/value heads read in
    place on CPU."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = kwargs.get("position_bias") is None and kwargs.get("cache") is None  # what this path leaves out
    if query.device.type != "cpu" or getattr(module, "num_key_value_groups", 1) == 1 or not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    output = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True,
        is_causal=bool(query.shape[2] > 1 and attention_mask is None and causal))
    return output.transpose(1, 2).contiguous(), None


def assigned_gpu() -> Optional[int]:
    """The CUDA index, among the devices this process sees, of the first GPU Ray assigned to this
    actor; None outside a Ray actor or when it was assigned none.

    Ray narrows CUDA_VISIBLE_DEVICES to the actor's GPUs (index 0 then), unless told not to, when
    the assigned ids are positions in the node's list.
    """
    if not _in_actor():
        return None
    ids = [str(i) for i in ray.get_gpu_ids()]
    if not ids:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return min(int(i) for i in ids)
    order = [v.strip() for v in visible.split(",")]
    return min((order.index(i) for i in ids if i in order), default=0)


def _gpu_here(gpu: Optional[int]) -> bool:
    """Whether `auto` means CUDA: in a Ray actor, when Ray assigned it a GPU; elsewhere, when one is visible."""
    return torch.cuda.is_available() and (gpu is not None or not _in_actor())


def _in_actor() -> bool:
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor`, built on the host, on `device` without the host waiting for the device: a copy to a GPU goes
    from pinned memory on the current stream, where one from pageable memory first waits for all work queued."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
