"""Algorithm components of the RL step: advantage estimators, off-policy corrections, loss terms.

Estimators turn groups of scalar rewards (one list per prompt) into one advantage per completion;
corrections turn proximal and behaviour log-probs into per-token importance weights (no grad);
`policy_loss` combines both in a PPO-clip surrogate aggregated over tokens. All are pure functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple, TypeVar

import torch


@dataclass
class Totals:
    """The counts a loss over tokens is divided by. A minibatch scored in parts (micro-batches, ranks)
    passes every part the whole minibatch's totals, so the parts' losses and gradients sum to the whole's."""
    tokens: float  # masked tokens
    completions: float  # sequences

    @staticmethod
    def of(mask: torch.Tensor) -> "Totals":
        """The totals of the (batch, tokens) mask itself."""
        return Totals(mask.sum().item(), mask.shape[0])


Metrics = Dict[str, torch.Tensor]  # detached scalars: the learner reads a step's metrics back in one transfer
Groups = List[List[float]]  # rewards or advantages, one inner list per prompt
Correction = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
Aggregation = Callable[[torch.Tensor, torch.Tensor, Optional[int], Optional[Totals]], torch.Tensor]
Entry = TypeVar("Entry")


def grpo_advantages(rewards: Groups, std_normalize: bool = True, eps: float = 1e-6) -> Groups:
    """Reward minus its group mean, divided by the group's population std when `std_normalize`."""
    advantages = []
    for group in rewards:
        values = torch.tensor(group, dtype=torch.float64)
        centred = values - values.mean()
        if std_normalize:
            centred = centred / (values.std(unbiased=False) + eps)
        advantages.append(centred.tolist())
    return advantages


def rloo_advantages(rewards: Groups) -> Groups:
    """Reward minus the mean of the other G-1 rewards of its group (leave-one-out baseline)."""
    advantages = []
    for index, group in enumerate(rewards):
        if len(group) < 2:
            raise ValueError(f"rloo_advantages: group {index} has {len(group)} reward(s), but the leave-one-out "
                             f"baseline needs at least 2 completions per prompt; raise the group size")
        values = torch.tensor(group, dtype=torch.float64)
        others_mean = (values.sum() - values) / (len(group) - 1)
        advantages.append((values - others_mean).tolist())
    return advantages


def reinforce_pp_advantages(rewards: Groups, eps: float = 1e-6) -> Groups:
    """Reward minus its group mean, then whitened by the mean and population std over the whole batch."""
    centred = [values - values.mean() for values in (torch.tensor(g, dtype=torch.float64) for g in rewards)]
    batch = torch.cat(centred)
    mean, std = batch.mean(), batch.std(unbiased=False)
    return [((values - mean) / (std + eps)).tolist() for values in centred]


ADVANTAGE_ESTIMATORS: Dict[str, Callable[[Groups], Groups]] = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
}


@torch.no_grad()
def on_policy(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """Weight 1 on every token: no correction for stale samples (the comparison baseline)."""
    return torch.ones_like(proximal_logprobs)


@torch.no_grad()
def truncated_is(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """min(pi_prox / pi_behaviour, cap): the behaviour-to-proximal weight truncated at `cap` (TIS)."""
    return torch.exp(proximal_logprobs - behaviour_logprobs).clamp(max=cap)


@torch.no_grad()
def decoupled_ppo(proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, cap: float) -> torch.Tensor:
    """pi_prox / pi_behaviour, set to 0 on tokens where it exceeds `cap` (AReaL's decoupled PPO).

    With the PPO clip on r = pi_theta / pi_prox in `policy_loss`, the per-token objective is
        w * min(r * A, clip(r, 1 - eps, 1 + eps) * A),   w = pi_prox / pi_behaviour,
    (AReaL, arXiv:2505.24298; `ppo_actor_loss_fn` in inclusionAI/AReaL areal/utils/functional.py).
    Tokens with w > cap are dropped rather than truncated, as AReaL's `behav_imp_weight_cap`
    does; cap=math.inf gives the paper's uncapped objective.
    """
    weight = torch.exp(proximal_logprobs - behaviour_logprobs)
    return torch.where(weight <= cap, weight, torch.zeros_like(weight))


CORRECTIONS: Dict[str, Correction] = {
    "on_policy": on_policy,
    "truncated_is": truncated_is,
    "decoupled_ppo": decoupled_ppo,
}


def token_mean(values: torch.Tensor, mask: torch.Tensor, max_tokens: Optional[int] = None,
               totals: Optional[Totals] = None) -> torch.Tensor:
    """Sum over every masked token of the batch / number of masked tokens (of `totals`, when given)."""
    totals = totals or Totals.of(mask)
    return (values * mask).sum() / max(totals.tokens, 1)


def sequence_mean(values: torch.Tensor, mask: torch.Tensor, max_tokens: Optional[int] = None,
                  totals: Optional[Totals] = None) -> torch.Tensor:
    """Mean over the tokens of each completion, then mean over completions (GRPO's length normalisation)."""
    totals = totals or Totals.of(mask)
    return ((values * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / max(totals.completions, 1)


def fixed_length(values: torch.Tensor, mask: torch.Tensor, max_tokens: Optional[int] = None,
                 totals: Optional[Totals] = None) -> torch.Tensor:
    """Sum over masked tokens / (completions x `max_tokens`), a constant denominator (Dr. GRPO)."""
    if max_tokens is None or max_tokens <= 0:
        raise ValueError(f"aggregation 'fixed_length' needs max_tokens > 0 (the generation length limit), "
                         f"got {max_tokens!r}")
    totals = totals or Totals.of(mask)
    return (values * mask).sum() / (max(totals.completions, 1) * max_tokens)


AGGREGATIONS: Dict[str, Aggregation] = {
    "token_mean": token_mean,
    "sequence_mean": sequence_mean,
    "fixed_length": fixed_length,
}


def _lookup(registry: Dict[str, Entry], name: str, kind: str) -> Entry:
    """registry[name], or a ValueError that lists the valid names."""
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; choose one of {sorted(registry)}")
    return registry[name]


def policy_loss(logprobs: torch.Tensor, proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, *, correction: str = "truncated_is",
                clip_eps: float = 0.2, is_cap: float = 2.0, aggregation: str = "token_mean",
                max_tokens: Optional[int] = None, totals: Optional[Totals] = None) -> Tuple[torch.Tensor, Metrics]:
    """PPO-clip surrogate on r = pi_theta / pi_prox, weighted per token by `correction`, then aggregated.

    Per token: loss_t = -w_t * min(r_t * A, clip(r_t, 1 - clip_eps, 1 + clip_eps) * A), with
    w_t = CORRECTIONS[correction](proximal, behaviour, is_cap) and A the completion's advantage (or the token's own).
    Shapes: log-probs and mask (batch, tokens); advantages (batch,), or (batch, tokens) per token. `max_tokens` is
    for "fixed_length".
    With `totals` (a part of a larger minibatch) the loss and the token-averaged metrics are this part's
    share of the minibatch's: summing them over the parts gives the minibatch's values.
    """
    weigh = _lookup(CORRECTIONS, correction, "correction")
    aggregate = _lookup(AGGREGATIONS, aggregation, "aggregation")
    masked = mask.bool()
    proximal = proximal_logprobs.detach()
    behaviour = behaviour_logprobs.detach()
    weight = torch.where(masked, weigh(proximal, behaviour, is_cap), torch.zeros_like(proximal))
    ratio = torch.exp(logprobs - proximal)
    advantage = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1)
    unclipped = ratio * advantage
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantage
    loss = aggregate(-weight * torch.minimum(unclipped, clipped), mask, max_tokens, totals)
    tokens = max((totals or Totals.of(mask)).tokens, 1)
    clipped_selected = (clipped < unclipped).detach() & masked
    mismatch = torch.where(masked, (proximal - behaviour).abs(), torch.zeros_like(proximal))
    return loss, {
        "pg_loss": loss.detach(),
        "clip_fraction": clipped_selected.sum() / tokens,
        "importance_weight_mean": weight.sum() / tokens,
        "importance_weight_max": weight.max(),
        "logprob_mismatch_abs": mismatch.sum() / tokens,
    }


def parity_sums(learner_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor,
                mask: torch.Tensor, kind: str = "") -> Metrics:
    """Engine-learner parity over the masked tokens (those sampled by the weights the learner scores them with):
    their count, the sum and maximum of |learner - engine| log-prob, and the sum of the k3 estimate of
    KL(engine || learner), exp(d) - 1 - d with d = learner - engine (the samples are the engine's).
    `kind` names a variant of the learner's scores (`parity_<kind>_...`: "replayed", "unreplayed")."""
    masked = mask.bool()
    gap = torch.where(masked, learner_logprobs.detach() - behaviour_logprobs.detach(), torch.zeros_like(mask))
    name = f"parity_{kind}_" if kind else "parity_"
    return {name + "tokens": masked.sum().to(gap.dtype), name + "abs_sum": gap.abs().sum(),
            name + "abs_max": gap.abs().max(), name + "k3_sum": (torch.expm1(gap) - gap).sum()}


def parity_figures(metrics: Dict[str, float], kind: str = "") -> Dict[str, float]:
    """`parity_sums` (of `kind`) summed over a step as the step's figures: mean and max |Δ log-prob|, mean k3
    and the tokens measured (none: no figures)."""
    name = f"parity_{kind}_" if kind else "parity_"
    tokens, abs_sum, k3_sum = (metrics.pop(name + k, 0.0) for k in ("tokens", "abs_sum", "k3_sum"))
    abs_max = metrics.pop(name + "abs_max", 0.0)
    if not tokens:
        return {}
    return {name + "abs_mean": abs_sum / tokens, name + "abs_max": abs_max, name + "k3": k3_sum / tokens,
            name + "tokens": tokens}


def distillation_signal(teacher_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, coef: float) -> torch.Tensor:
    """On-policy distillation's per-token advantage: coef x (log teacher(x_t) - log student(x_t)) on the student's
    own samples, minus `coef` times the per-token estimate of the reverse KL(student || teacher), whose
    policy gradient it is (the sampled log-probs stand for the student's)."""
    return coef * (teacher_logprobs - behaviour_logprobs)


def entropy_bonus(entropy: torch.Tensor, mask: torch.Tensor, coef: float,
                  totals: Optional[Totals] = None) -> torch.Tensor:
    """Term to add to the loss: -coef x token-mean entropy (entropy per token, with grad)."""
    return -coef * token_mean(entropy, mask, totals=totals)


def sft_auxiliary_loss(logprobs: torch.Tensor, mask: torch.Tensor, coef: float,
                       totals: Optional[Totals] = None) -> torch.Tensor:
    """Term to add to the loss: coef x token-mean negative log-likelihood of the masked tokens."""
    return coef * -token_mean(logprobs, mask, totals=totals)
