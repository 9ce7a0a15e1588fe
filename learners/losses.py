"""Losses and advantages: pure functions over tensors, each returning the loss and its metrics.

`sft_loss` is the mean negative log-likelihood of target tokens. `grpo_loss` is the clipped
policy-gradient loss with group-normalised advantages, corrected for stale samples: each token
is weighted by the truncated importance weight min(pi_prox / pi_behaviour, cap), where the
proximal policy is the learner's own weights at the start of the step (decoupled PPO).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

Metrics = Dict[str, float]


def group_advantages(rewards: List[List[float]], std_normalize: bool = True, eps: float = 1e-6) -> List[List[float]]:
    """Reward minus the group mean, divided by the group std when `std_normalize`."""
    advantages = []
    for group in rewards:
        values = torch.tensor(group, dtype=torch.float64)
        centred = values - values.mean()
        if std_normalize:
            centred = centred / (values.std(unbiased=False) + eps)
        advantages.append(centred.tolist())
    return advantages


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor) -> Tuple[torch.Tensor, Metrics]:
    """Mean negative log-likelihood over the tokens where `mask` is 1."""
    tokens = mask.sum().clamp(min=1)
    loss = -(logprobs * mask).sum() / tokens
    return loss, {"loss": loss.item(), "tokens": tokens.item()}


@dataclass
class PolicyLossInputs:
    logprobs: torch.Tensor  # (batch, tokens) under the weights being trained, with grad
    behaviour_logprobs: torch.Tensor  # (batch, tokens) recorded by the rollout worker
    advantages: torch.Tensor  # (batch,) one per completion
    mask: torch.Tensor  # (batch, tokens) 1 on completion tokens
    reference_logprobs: Optional[torch.Tensor] = None  # (batch, tokens) under the frozen reference


def reference_kl(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): exp(r) - r - 1 with r = log pi_ref - log pi (>= 0)."""
    log_ratio = reference_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def grpo_loss(inputs: PolicyLossInputs, clip_eps: float, is_cap: float,
              kl_coef: float = 0.0) -> Tuple[torch.Tensor, Metrics]:
    """Token-mean clipped surrogate weighted by truncated importance weights, plus kl_coef * KL to reference."""
    mask = inputs.mask
    tokens = mask.sum().clamp(min=1)
    proximal = inputs.logprobs.detach()
    importance = torch.exp(proximal - inputs.behaviour_logprobs).clamp(max=is_cap)
    ratio = torch.exp(inputs.logprobs - proximal)
    advantages = inputs.advantages.unsqueeze(-1)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages)
    pg_loss = -(importance * surrogate * mask).sum() / tokens
    loss = pg_loss
    masked = mask.bool()
    metrics: Metrics = {}
    if inputs.reference_logprobs is not None:
        kl = (reference_kl(inputs.logprobs, inputs.reference_logprobs) * mask).sum() / tokens
        loss = loss + kl_coef * kl
        metrics["kl_to_reference"] = kl.item()
    mismatch = (proximal - inputs.behaviour_logprobs)[masked]
    clipped = ((ratio < 1 - clip_eps) | (ratio > 1 + clip_eps))[masked]
    return loss, {
        **metrics,
        "loss": loss.item(),
        "pg_loss": pg_loss.item(),
        "clip_fraction": clipped.float().mean().item(),
        "importance_weight_mean": importance[masked].mean().item(),
        "importance_weight_max": importance[masked].max().item(),
        "logprob_mismatch_abs": mismatch.abs().mean().item(),
        "tokens": tokens.item(),
    }
