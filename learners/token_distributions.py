"""Whole next-token distributions on completions, for on-policy distillation in `forward_kl` mode.

Data flow: a teacher worker runs `completion_log_softmax` over the student's samples and keeps each
completion token's `top_tokens` (the teacher's k most likely ids and their log-probs) on the sample ->
the student's learner lines them up with its batch (`align_top`), scores the same positions with its own
`completion_log_softmax` and adds `forward_kl_on_top` (KL(teacher || student) over the teacher's top
tokens) to its loss. Unlike the learner's fused scoring (`head_scores`), these passes keep the whole
(batch, positions, vocabulary) log-softmax: one model pass more per distilled micro-batch.

Positions follow `batching.align_per_token`: in a (batch, width) layout, position i of a row predicts
token i + 1 of its prompt and completion; a completion's first token is predicted at len(prompt) - 1.
"""

from __future__ import annotations

from typing import List, Tuple

import torch

from rlplatform.devices import to_device


def completion_log_softmax(model, prompts: List[List[int]], completions: List[List[int]], pad_id: int,
                           temperature: float = 1.0) -> torch.Tensor:
    """(batch, width, vocabulary) float32 log-softmax of `model`'s logits / `temperature` at every position of
    the right-padded prompts and completions (width: the longest row's tokens - 1)."""
    rows = [p + c for p, c in zip(prompts, completions)]
    width = max(len(r) for r in rows)
    device = next(model.parameters()).device
    ids = torch.tensor([row + [pad_id] * (width - len(row)) for row in rows])  # built on the host, copied once
    attention = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    logits = model(input_ids=to_device(ids, device), attention_mask=to_device(attention, device)).logits[:, :-1]
    return torch.log_softmax(logits.float() / temperature, dim=-1)


def top_tokens(log_softmax: torch.Tensor, prompts: List[List[int]], completions: List[List[int]],
               k: int) -> List[Tuple[List[float], List[List[int]], List[List[float]]]]:
    """Per sample, per completion token: its own log-prob, and the k most likely ids at its position with their
    log-probs."""
    values, ids = log_softmax.topk(min(k, log_softmax.shape[-1]), dim=-1)
    found = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        span = slice(len(prompt) - 1, len(prompt) - 1 + len(completion))
        sampled = log_softmax[i, span].gather(-1, torch.tensor(completion, device=log_softmax.device)[:, None])
        found.append((sampled[:, 0].tolist(), ids[i, span].tolist(), values[i, span].tolist()))
    return found


def align_top(ids: List[List[List[int]]], logprobs: List[List[List[float]]], prompts: List[List[int]],
              width: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Samples' teacher top tokens (each sample the same k at every token, as the wire format holds them) as
    (batch, width, k) ids and log-probs at their completion tokens' positions; elsewhere id 0 at log-prob -inf (no
    weight)."""
    k = max((len(sample[0]) for sample in ids if sample), default=1)
    top_ids = torch.zeros((len(ids), width, k), dtype=torch.long)
    top_logprobs = torch.full((len(ids), width, k), float("-inf"))
    for i, (sample_ids, sample_logprobs, prompt) in enumerate(zip(ids, logprobs, prompts)):
        if sample_ids:
            span = slice(len(prompt) - 1, len(prompt) - 1 + len(sample_ids))
            top_ids[i, span, :len(sample_ids[0])] = torch.tensor(sample_ids)
            top_logprobs[i, span, :len(sample_ids[0])] = torch.tensor(sample_logprobs)
    return top_ids, top_logprobs


def forward_kl_on_top(student: torch.Tensor, top_ids: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """(batch, width) per position: sum over the teacher's top tokens of p_teacher (log p_teacher - log
    p_student), from the student's (batch, width, vocabulary) log-softmax and the teacher's (batch, width, k)
    ids and log-probs; 0 where the teacher gave none. The forward KL's terms on those tokens: 0 where the student
    matches the teacher on them, below 0 where it gives them more than the teacher does (the rest of the
    vocabulary is left out). Its gradient moves the student's mass onto the tokens the teacher would have chosen,
    in the teacher's proportions."""
    weights = teacher.exp()  # 0 at -inf
    gap = torch.where(weights > 0, teacher - student.gather(-1, top_ids), torch.zeros_like(teacher))
    return (weights * gap).sum(-1)
