"""Weight snapshots keep each tensor's dtype through the Ray object store, bfloat16 included (numpy
has none: its raw bits travel and come back unchanged); the config picks one transport strategy."""

from __future__ import annotations

import pytest
import ray
import torch

from rlplatform.transport.weights import BFLOAT16, from_snapshot, to_snapshot


def special_values(dtype: torch.dtype) -> torch.Tensor:
    """Random values plus the edge cases a numeric conversion would alter: signed zero, inf, nan, subnormals."""
    tiny = torch.finfo(dtype).tiny
    edges = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), tiny / 4, -tiny / 8, 1e-3, 3.0e4])
    return torch.cat([torch.randn(64, generator=torch.Generator().manual_seed(0)), edges]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_round_trip_through_the_object_store_is_bit_exact(ray_session, dtype):
    weights = {"layer.weight": special_values(dtype).reshape(-1, 1), "layer.bias": special_values(dtype)[:5]}
    snapshot = ray.get(ray.put(to_snapshot(weights)))
    assert {a.dtype for a in snapshot.values()} == {BFLOAT16 if dtype == torch.bfloat16 else dtype_numpy(dtype)}
    back = from_snapshot(snapshot)
    for name, tensor in weights.items():
        assert back[name].dtype == dtype and back[name].shape == tensor.shape
        assert torch.equal(back[name].view(torch.uint8), tensor.view(torch.uint8))  # the same bits


def dtype_numpy(dtype: torch.dtype):
    return torch.empty(0, dtype=dtype).numpy().dtype


def test_bfloat16_snapshot_is_half_the_bytes_and_loads_into_a_bfloat16_model():
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    snapshot = to_snapshot(model.state_dict())
    assert sum(a.nbytes for a in snapshot.values()) == 2 * (8 * 4 + 4)
    target = torch.nn.Linear(8, 4).to(torch.bfloat16)
    target.load_state_dict(from_snapshot(snapshot))
    assert torch.equal(target.weight, model.weight) and torch.equal(target.bias, model.bias)


def test_the_config_picks_one_transport_strategy_with_its_settings():
    import pickle

    from rlplatform.config import WeightsConfig
    from rlplatform.transport.weight_transports import (BroadcastTransport, CudaIpcTransport, ObjectStoreTransport,
                                                        weight_transport)

    picked = {name: weight_transport(WeightsConfig(transport=name, bucket_mb=8.0))
              for name in ("object_store", "broadcast", "cuda_ipc")}
    assert picked == {"object_store": ObjectStoreTransport(), "broadcast": BroadcastTransport(8.0),
                      "cuda_ipc": CudaIpcTransport()}
    assert picked["broadcast"].bucket_bytes == 8 * 2 ** 20
    # only the object store holds each version as a snapshot the evaluator can read as it is
    assert [name for name, t in picked.items() if t.snapshots_in_store] == ["object_store"]
    assert all(pickle.loads(pickle.dumps(t)) == t for t in picked.values())  # they travel to the actors
