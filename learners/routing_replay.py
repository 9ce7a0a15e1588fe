"""Routing replay in the learner: a mixture-of-experts policy's tokens scored through the experts the engine that
generated them chose (`Sample.routed_experts`), so the learner's log-probs are those of the computation that
sampled them even where its own routers would pick other experts (rounding, kernels, a router that moved).

`RoutingReplay` holds a forward hook on each router. While it has a plan (`Routes.follow`, set before each
forward pass a layout makes), a token with recorded experts goes to them, weighted by the router's own current
probabilities at them (renormalised over the k where the router renormalises), so the router still gets its
gradient; every other token (padding, a sequence's last token, a sample without a record) keeps the router's own
choice. With `replace` off it only observes. Either way it can count router agreement: the share of recorded
tokens whose top-k the router chose itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from rlplatform.devices import to_device


class RoutingReplay:
    """Hooks on `routers` that route each forward pass as its plan says (`replace`) or only compare (`count`)."""

    def __init__(self, routers: List[torch.nn.Module], replace: bool = True, count: bool = False) -> None:
        self.routers, self.replace, self.count = routers, replace, count
        self.plan: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # (tokens, layers, k) experts, (tokens,) recorded
        self.agreed = torch.zeros(())  # recorded tokens whose own top-k was the recorded one (counted passes)
        self.recorded = torch.zeros(())  # recorded tokens the counted passes routed, over all layers
        self._hooks: List = []

    def __enter__(self) -> "RoutingReplay":
        self._hooks = [router.register_forward_hook(self._router_hook(layer)) for layer, router in
                       enumerate(self.routers)]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self.plan = [], None

    def _router_hook(self, layer: int):
        def route(router, inputs, output):
            if self.plan is None:
                return None
            logits, weights, own = output
            experts, recorded = self.plan[0][:, layer], self.plan[1]
            if experts.shape[0] != own.shape[0]:
                raise RuntimeError(f"routing replay planned {experts.shape[0]} tokens; layer {layer}'s router saw "
                                   f"{own.shape[0]}")
            if self.count:
                same = (own.sort(-1).values == experts.sort(-1).values).all(-1) & recorded
                self.agreed = self.agreed.to(same.device) + same.sum()
                self.recorded = self.recorded.to(same.device) + recorded.sum()
            if not self.replace:
                return None
            chosen = torch.where(recorded[:, None], experts, own)
            probs = torch.softmax(logits.float(), dim=-1).gather(-1, chosen)
            if getattr(router, "norm_topk_prob", False):
                probs = probs / probs.sum(-1, keepdim=True)
            return logits, probs.to(weights.dtype), chosen
        return route


@dataclass
class Routes:
    """One batch's recorded routing, each sequence's (positions, layers, k) expert ids (None: not recorded), and
    the replay whose plan each forward pass over the batch sets."""
    replay: RoutingReplay
    experts: List[Optional[torch.Tensor]]

    def follow(self, sequence: torch.Tensor, position: torch.Tensor, device: torch.device) -> None:
        """Plan the next forward pass, whose tokens are, row-major, token `position[r, c]` of sequence
        `sequence[r, c]` (-1: none of the batch's, e.g. padding)."""
        layers, top_k = len(self.replay.routers), self.replay.routers[0].top_k
        lengths = torch.tensor([0 if e is None else len(e) for e in self.experts])
        table = torch.cat([torch.zeros(1, layers, top_k, dtype=torch.long)] +
                          [e for e in self.experts if e is not None])  # row 0: the experts of no recorded token
        offsets = lengths.cumsum(0) - lengths + 1
        sequence, position = sequence.reshape(-1), position.reshape(-1)
        owner = sequence.clamp(min=0)
        recorded = (sequence >= 0) & (position >= 0) & (position < lengths[owner])
        rows = torch.where(recorded, offsets[owner] + position, torch.zeros_like(position))
        self.replay.plan = (to_device(table[rows], device), to_device(recorded, device))
