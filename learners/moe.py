"""Mixture-of-experts policies in the learner: the routers a model holds, and the load-balancing loss over the
routing of the tokens a forward pass scored (`RouterLoad`), which the rank adds to its loss and reports.

The routers are `rlplatform.policy.routers`; their logits are one row per token, in the order the layer saw them.
"""

from __future__ import annotations

from typing import List

import torch


def aux_loss_coef(model: torch.nn.Module) -> float:
    """The weight of the load-balancing loss the model's config gives (0 where it gives none: a dense model)."""
    return float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)


def load_balancing_loss(logits: List[torch.Tensor], top_k: int) -> torch.Tensor:
    """E x sum over experts of (share of the token-expert assignments the expert got) x (its mean router
    probability), averaged over the layers: 1 when routing is even, up to E when every token goes to the same
    experts (Switch Transformer's auxiliary loss, with top-k assignments). `logits`: each layer's (tokens,
    experts) router logits."""
    losses = []
    for layer in logits:
        probs = torch.softmax(layer.float(), dim=-1)
        experts = probs.shape[-1]
        chosen = torch.topk(probs, top_k, dim=-1).indices
        share = torch.zeros(experts, device=probs.device).index_add_(
            0, chosen.reshape(-1), torch.ones(chosen.numel(), device=probs.device)) / max(chosen.numel(), 1)
        losses.append(experts * (share * probs.mean(dim=0)).sum())
    return torch.stack(losses).mean()


class RouterLoad:
    """While entered, records the logits of each of a model's `routers` from every forward pass with a gradient;
    `loss()` is then the load-balancing loss of what was recorded (`load_balancing_loss`). Every token a pass
    routed counts, the padding of a batch's shorter rows included (a few percent of a packed batch's). Enter it
    around the forward passes alone: the passes activation checkpointing recomputes in backward are not routing
    decisions of their own."""

    def __init__(self, routers: List[torch.nn.Module]) -> None:
        self.routers = routers
        self.top_k = self.routers[0].top_k if self.routers else 0
        self._logits: List[List[torch.Tensor]] = [[] for _ in self.routers]
        self._hooks: List = []

    def __enter__(self) -> "RouterLoad":
        self._hooks = [router.register_forward_hook(self._recorder(i)) for i, router in enumerate(self.routers)]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _recorder(self, layer: int):
        def record(module, inputs, output) -> None:
            if torch.is_grad_enabled():  # scoring passes without a gradient do not train the routers
                self._logits[layer].append(output[0])
        return record

    def loss(self) -> torch.Tensor:
        """The load-balancing loss over the tokens routed while entered."""
        return load_balancing_loss([torch.cat(layer) for layer in self._logits], self.top_k)
