"""The transformers engine's record of a mixture-of-experts policy's routing: for every token its decode loop runs
through the model, the experts each layer chose (`Completion.routed_experts`, which the learner replays).

`RoutingRecorder` holds a forward hook on each of the model's routers (`rlplatform.policy.routers`); after a
forward pass, `take` returns what that pass routed, in the order the pass fed its tokens.
"""

from __future__ import annotations

from typing import List, Optional

import torch

from rlplatform.policy import routers
from rlplatform.transport.routed_experts import id_dtype


class RoutingRecorder:
    """The experts each router of `model` chose in the model's latest forward pass."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = routers(model)
        self.num_experts, self.top_k = self.routers[0].num_experts, self.routers[0].top_k
        self.dtype = id_dtype(self.num_experts)
        self._chosen: List[Optional[torch.Tensor]] = [None] * len(self.routers)
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._recorder(layer))

    @classmethod
    def of(cls, model: torch.nn.Module) -> Optional["RoutingRecorder"]:
        """A recorder for a mixture-of-experts model; None for a dense one."""
        return cls(model) if routers(model) else None

    def _recorder(self, layer: int):
        def record(module, inputs, output) -> None:
            self._chosen[layer] = output[2].to(self.dtype)
        return record

    def take(self, rows: int, columns: int) -> torch.Tensor:
        """(rows, columns, layers, k): the experts of the latest pass, which fed `rows` x `columns` tokens."""
        chosen = torch.stack(self._chosen, dim=1)
        self._chosen = [None] * len(self.routers)
        return chosen.view(rows, columns, len(self.routers), self.top_k)
