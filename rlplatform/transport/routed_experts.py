"""The experts a mixture-of-experts policy routed each token to, as they travel from the engine that generated a
sample to the learner that replays them (`Sample.routed_experts`).

A sample's routing is a (positions, layers, k) array of expert ids: position t holds the experts each MoE layer
chose for token t of prompt + completion, for every token the engine ran through the model (all but the last:
its hidden state predicts nothing the learner scores). On the wire it is the array's raw bytes, one byte per id
where the model has at most 256 experts a layer (two bytes, little-endian, otherwise): layers x k bytes a token.
"""

from __future__ import annotations

from typing import Sequence

import torch

ONE_BYTE_EXPERTS = 256  # expert ids below this fit one byte


def id_dtype(num_experts: int) -> torch.dtype:
    """The dtype expert ids travel in: uint8 up to `ONE_BYTE_EXPERTS` experts a layer, int16 beyond."""
    return torch.uint8 if num_experts <= ONE_BYTE_EXPERTS else torch.int16


def bytes_per_token(layers: int, top_k: int, num_experts: int) -> int:
    """What one token's routing costs on the wire."""
    return layers * top_k * id_dtype(num_experts).itemsize


def encode_routing(chunks: Sequence[torch.Tensor]) -> bytes:
    """Consecutive (positions, layers, k) pieces of one sequence's routing, their ids already in `id_dtype`, as
    wire bytes (none: empty)."""
    return torch.cat(list(chunks)).cpu().contiguous().numpy().tobytes() if chunks else b""


def decode_routing(data: bytes, layers: int, top_k: int, num_experts: int) -> torch.Tensor:
    """Wire bytes back to a (positions, layers, k) long tensor of expert ids (empty bytes: no positions).
    Raises ValueError when the bytes are not whole tokens of this shape or name an expert the model lacks."""
    dtype = id_dtype(num_experts)
    per_token = bytes_per_token(layers, top_k, num_experts)
    if len(data) % per_token:
        raise ValueError(f"{len(data)} bytes of routed experts are not whole tokens of {layers} layers x top-{top_k} "
                         f"({per_token} bytes a token)")
    experts = torch.frombuffer(bytearray(data), dtype=dtype).view(-1, layers, top_k).long() if data else \
        torch.zeros(0, layers, top_k, dtype=torch.long)
    if experts.numel() and (int(experts.min()) < 0 or int(experts.max()) >= num_experts):
        raise ValueError(f"routed experts name expert {int(experts.max())}; the model has {num_experts} a layer")
    return experts
