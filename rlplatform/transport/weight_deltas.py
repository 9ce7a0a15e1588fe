"""Delta weight sync (`weights.delta`): after a full version, each version carries only the elements
whose value changed, in the dtype the engines hold (the bits compared, so -0.0 and NaN count too).

Data flow: learner rank 0's `DeltaEncoder` turns each version's weights into an update (a full one
first and every `weights.delta_full_every` versions, a delta in between) -> any transport carries the
update as a plain dict of tensors -> a receiver that took several updates since its engine last loaded
folds them into one (`combine`) -> the engine loads a full update as weights, or writes a delta's
elements in place (`apply_delta`) after checking it holds the version the delta starts from.

A delta is a dict of tensors: `DELTA_OF` holds the version it starts from; each changed weight
`name` travels in whichever of three forms is fewest bytes: `name@idx` (flat int32/int64 positions,
ascending) with `name@val` (their new values), when few elements changed; `name@mask` (one bit per
element, packed 8 to a byte) with `name@val`, when more did; or whole under its own name.
"""

from __future__ import annotations

from typing import Dict, Iterator, Optional

import torch

from rlplatform.transport.weight_store import full_version
from rlplatform.transport.weights import unique_weights

Weights = Dict[str, torch.Tensor]
DELTA_OF = "@delta_of"  # the version a delta starts from; a full update has no such entry
IDX, MASK, VAL = "@idx", "@mask", "@val"
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # a dtype's bits, by element size


def delta_of(update: Weights) -> Optional[int]:
    """The version `update` starts from when it is a delta; None for full weights."""
    base = update.get(DELTA_OF)
    return None if base is None else int(base.reshape(-1)[0])


def update_bytes(update: Weights) -> int:
    """The bytes `update` carries."""
    return sum(t.numel() * t.element_size() for t in update.values())


class DeltaEncoder:
    """Learner rank 0's end: each version as the update to send, keeping a copy of what engines now hold."""

    def __init__(self, full_every: int) -> None:
        self.full_every = full_every
        self._held: Optional[Weights] = None  # the weights as of `_version`, in the served dtype
        self._version = -1

    def encode(self, weights: Weights, version: int) -> Weights:
        """Full weights for the first version and every `full_every`-th, else the delta from the last one;
        each storage once (a tied output head travels as the embedding)."""
        weights = unique_weights(weights)
        if self._held is None or full_version(version, self.full_every):
            self._held = {name: t.detach().clone() for name, t in weights.items()}
            self._version = version
            return weights
        update: Weights = {DELTA_OF: torch.tensor([self._version], dtype=torch.int64)}
        for name, tensor in weights.items():
            held, new = self._held[name].view(-1), tensor.detach().reshape(-1)
            changed = _bits(new) != _bits(held)
            update.update(_changes(name, tensor.detach(), changed))
            held[changed] = new[changed]
        self._version = version
        return update


def _changes(name: str, tensor: torch.Tensor, changed: torch.Tensor) -> Weights:
    """Weight `name`'s entries of a delta: the elements of `tensor` flagged in `changed` (flat), in the
    fewest bytes."""
    new, positions = tensor.reshape(-1), changed.nonzero().reshape(-1)
    count, numel, size = len(positions), new.numel(), new.element_size()
    if not count:
        return {}
    index_size = 4 if numel < 2 ** 31 else 8
    sizes = {IDX: count * (index_size + size), MASK: -(-numel // 8) + count * size, name: numel * size}
    form = min(sizes, key=sizes.get)
    if form == name:
        return {name: tensor}
    if form == IDX:
        return {name + IDX: positions.to(torch.int32 if index_size == 4 else torch.int64), name + VAL: new[positions]}
    return {name + MASK: _pack_bits(changed), name + VAL: new[positions]}


def load_delta(weights: Weights, delta: Weights, held_version: int) -> None:
    """`apply_delta` into an engine's weights, which must hold the version the delta starts from."""
    if delta_of(delta) != held_version:
        raise RuntimeError(f"a weight delta from version {delta_of(delta)} reached an engine holding version "
                           f"{held_version}: the versions in between are lost (a receiver that joined late?); "
                           "restart the job, or turn weights.delta off")
    with torch.no_grad():
        apply_delta(weights, delta)


def apply_delta(weights: Weights, delta: Weights) -> None:
    """Write `delta`'s elements into `weights` (name -> tensor, e.g. a model's parameters) in place."""
    for name in changed_names(delta):
        target = weights[name]
        if name in delta:
            target.copy_(delta[name].reshape(target.shape).to(target.device))
        else:
            positions = _positions(delta, name).to(target.device)
            target.view(-1)[positions] = delta[name + VAL].to(target.device, target.dtype)


def combine(held: Optional[Weights], newer: Weights) -> Weights:
    """One update with the effect of `held` then `newer` (the updates a receiver took, in order); a
    full `held` is copied where `newer` changes it, never written (it may be shared memory)."""
    if held is None or delta_of(newer) is None:
        return newer
    out = dict(held)
    if delta_of(held) is None:
        for name in changed_names(newer):
            out[name] = out[name].clone()
        apply_delta(out, newer)
        return out
    held_changes = set(changed_names(held))
    for name in changed_names(newer):
        for suffix in (IDX, MASK, VAL):
            out.pop(name + suffix, None)
        if name in newer:  # whole: replaces whatever `held` had for it
            out[name] = newer[name]
        elif name in held:  # `held` has it whole: the newer elements written into a copy
            out[name] = held[name].clone()
            apply_delta(out, {name + IDX: _positions(newer, name), name + VAL: newer[name + VAL]})
        else:  # the elements of both, the newer value where both changed one
            old = _positions(held, name) if name in held_changes else torch.zeros(0, dtype=torch.int64)
            old_values = held.get(name + VAL, newer[name + VAL][:0])
            new = _positions(newer, name)
            kept = ~torch.isin(old, new)
            out[name + IDX] = torch.cat([old[kept], new])
            out[name + VAL] = torch.cat([old_values[kept], newer[name + VAL]])
    return out


def changed_names(update: Weights) -> Iterator[str]:
    """The weights an update changes."""
    for key in update:
        if key == DELTA_OF or key.endswith(VAL):
            continue
        yield key.removesuffix(IDX).removesuffix(MASK)


def _positions(delta: Weights, name: str) -> torch.Tensor:
    """The flat positions (int64, ascending) of the elements `delta` changes in weight `name`."""
    if name + IDX in delta:
        return delta[name + IDX].to(torch.int64)
    return _unpack_bits(delta[name + MASK]).nonzero().reshape(-1)


_BIT_WEIGHTS = (128, 64, 32, 16, 8, 4, 2, 1)


def _pack_bits(flags: torch.Tensor) -> torch.Tensor:
    """A flat bool tensor as bytes, 8 flags each, the first in the highest bit (padded with False)."""
    padded = torch.nn.functional.pad(flags.to(torch.uint8), (0, -len(flags) % 8))
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=flags.device)
    return (padded.view(-1, 8) * weights).sum(1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """`_pack_bits`' flags (a multiple of 8 of them: the padding reads as False)."""
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=packed.device)
    return (packed.unsqueeze(1) & weights).ne(0).reshape(-1)


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(_BITS[tensor.element_size()])
