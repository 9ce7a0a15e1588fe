"""Loss terms outside the policy gradient: the SFT negative log-likelihood and the KL estimate
to a frozen reference policy. Pure functions over tensors (the policy-gradient losses, advantage
estimators and off-policy corrections are in `algorithms.py`)."""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

Metrics = Dict[str, torch.Tensor]  # detached scalars: the learner reads a step's metrics back in one transfer


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor, denominator: Optional[float] = None
             ) -> Tuple[torch.Tensor, Metrics]:
    """Negative log-likelihood summed over the tokens where `mask` is 1, divided by `denominator`
    (default: those tokens, a mean)."""
    tokens = mask.sum()
    loss = -(logprobs * mask).sum() / (denominator or tokens.clamp(min=1))
    return loss, {"loss": loss.detach(), "tokens": tokens}


def reference_kl(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): exp(r) - r - 1 with r = log pi_ref - log pi (>= 0)."""
    log_ratio = reference_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1
