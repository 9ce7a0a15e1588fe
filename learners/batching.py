"""Turning token-id sequences into padded tensors and per-token log-probs under a model.

Both the SFT and the RL step score completions given prompts: sequences are packed
right-padded, the model runs once, and the log-prob of every completion token is gathered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch


def pack(prompts: List[List[int]], completions: List[List[int]], pad_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, completion_mask) for prompt+completion pairs, right-padded with `pad_id`.

    completion_mask[i, t] is 1 where input_ids[i, t + 1] is a completion token, so it lines
    up with next-token log-probs of positions 0..T-2. Right padding needs no attention mask:
    under causal attention no real token attends to the pads after it.
    """
    length = max(len(p) + len(c) for p, c in zip(prompts, completions))
    input_ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    completion_mask = torch.zeros((len(prompts), length - 1), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        input_ids[i, :len(p) + len(c)] = torch.tensor(p + c)
        completion_mask[i, len(p) - 1:len(p) + len(c) - 1] = 1
    return input_ids, completion_mask


@dataclass
class TokenScores:
    logprobs: torch.Tensor  # (batch, T-1) log-prob of each next token
    mask: torch.Tensor  # (batch, T-1) 1 on completion tokens
    entropy: torch.Tensor  # (batch, T-1) entropy of each next-token distribution


def completion_logprobs(model, prompts: List[List[int]], completions: List[List[int]], pad_id: int,
                        temperature: float = 1.0, entropy_grad: bool = False) -> TokenScores:
    """Score completions given prompts with one forward pass of `model`; the entropy carries a
    gradient only with `entropy_grad` (an entropy bonus needs it, metrics do not)."""
    input_ids, completion_mask = pack(prompts, completions, pad_id)
    logits = model(input_ids=input_ids, use_cache=False).logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    all_logprobs = torch.log_softmax(logits, dim=-1)
    logprobs = all_logprobs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(all_logprobs.exp() * all_logprobs).sum(-1)
    return TokenScores(logprobs, completion_mask, entropy)


def align_per_token(values: List[List[float]], prompts: List[List[int]], width: int) -> torch.Tensor:
    """Place per-completion-token values (e.g. behaviour log-probs) at their mask positions."""
    out = torch.zeros((len(values), width), dtype=torch.float32)
    for i, (v, p) in enumerate(zip(values, prompts)):
        out[i, len(p) - 1:len(p) - 1 + len(v)] = torch.tensor(v, dtype=torch.float32)
    return out
