"""Loss terms outside the policy gradient: the SFT negative log-likelihood and the KL estimate
to a frozen reference policy. Pure functions over tensors (the policy-gradient losses, advantage
estimators and off-policy corrections are in `algorithms.py`)."""

from __future__ import annotations

from typing import Dict, Tuple

import torch

Metrics = Dict[str, float]


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor) -> Tuple[torch.Tensor, Metrics]:
    """Mean negative log-likelihood over the tokens where `mask` is 1."""
    tokens = mask.sum().clamp(min=1)
    loss = -(logprobs * mask).sum() / tokens
    return loss, {"loss": loss.item(), "tokens": tokens.item()}


def reference_kl(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): exp(r) - r - 1 with r = log pi_ref - log pi (>= 0)."""
    log_ratio = reference_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1
