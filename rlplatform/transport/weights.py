"""Weight streaming: the learner publishes versioned weight snapshots, rollout workers pull them.

A snapshot is a dict of numpy arrays, in the weights' own dtype, put once in the Ray object store
(readers map it without a copy); numpy has no bfloat16, so bfloat16 weights travel as their raw
16 bits under the `BFLOAT16` dtype and come back bit for bit. The `WeightStore` actor holds the
newest reference and its version, and the version number is mirrored on Redis so workers can
check for news without a Ray call (the store itself is `weight_store.WeightStore`).
"""

from __future__ import annotations

import warnings
from typing import Dict

import numpy as np
import torch

BFLOAT16 = np.dtype([("bfloat16", np.int16)])  # the bits of a bfloat16 tensor, marked as such


def to_snapshot(state_dict: Dict[str, torch.Tensor]) -> Dict[str, np.ndarray]:
    """Arrays of the weights in their own dtype, each storage once (`unique_weights`)."""
    return {name: _to_array(tensor.detach().to("cpu")) for name, tensor in unique_weights(state_dict).items()}


def unique_weights(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Each storage once: a weight tied to an earlier one (an output head sharing the embedding) is
    left out, and loading restores it through the tie."""
    kept, seen = {}, set()
    for name, tensor in state_dict.items():
        key = _storage_key(tensor)
        if key not in seen:
            seen.add(key)
            kept[name] = tensor
    return kept


def cast_weights(state_dict: Dict[str, torch.Tensor], dtype: torch.dtype, copy: bool = False) -> Dict[str, torch.Tensor]:
    """The weights in `dtype`, each storage converted once, so weights tied to each other stay tied;
    with `copy`, new tensors even where the dtype already matches (else those are the same tensors)."""
    converted: Dict[tuple, torch.Tensor] = {}
    out = {}
    for name, tensor in state_dict.items():
        key = _storage_key(tensor)
        if key not in converted:
            converted[key] = tensor.detach().to(dtype, copy=copy)
        out[name] = converted[key]
    return out


def _storage_key(tensor: torch.Tensor) -> tuple:
    """What two tensors share exactly when one is tied to the other."""
    return tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape)


def _to_array(tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(BFLOAT16)
    return tensor.numpy()


def load_weights(model: torch.nn.Module, state_dict: Dict[str, torch.Tensor]) -> None:
    """Copy `state_dict` into `model`; only weights tied to one it holds may be absent from it."""
    result = model.load_state_dict(state_dict, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {params[name].data_ptr() for name in state_dict if name in params}
    untied = [name for name in result.missing_keys if name not in params or params[name].data_ptr() not in loaded]
    if untied or result.unexpected_keys:
        raise ValueError(f"weights do not fit the model: missing {untied}, unexpected {result.unexpected_keys}")


def from_snapshot(snapshot: Dict[str, np.ndarray]) -> Dict[str, torch.Tensor]:
    """Tensors viewing the (read-only, shared) snapshot arrays; load_state_dict copies them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return {name: _to_tensor(array) for name, array in snapshot.items()}


def _to_tensor(array: np.ndarray) -> torch.Tensor:
    if array.dtype == BFLOAT16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
