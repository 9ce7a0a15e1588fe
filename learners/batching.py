"""Turning token-id sequences into packed tensors and per-token log-probs under a model.

Both the SFT and the RL step score completions given prompts. Sequences are packed several to a
row (first fit, longest first) with positions restarting at each, so the model's attention stays
within each sequence and no compute goes to padding when lengths vary; the model runs once and
the log-prob of every completion token is gathered back to one row per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

ROW_TOKENS = 64  # packed row length, unless one sequence is longer


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # (rows, L) sequences back to back, then pad ids
    position_ids: torch.Tensor  # (rows, L) restarting at 0 with each sequence (and the padding)
    index: torch.Tensor  # (batch, W) flat index into (rows, L-1) of each sequence's next-token positions
    completion_mask: torch.Tensor  # (batch, W) 1 where that next token is a completion token


def pack(prompts: List[List[int]], completions: List[List[int]], pad_id: int,
         row_tokens: int = ROW_TOKENS) -> PackedBatch:
    """Pack prompt+completion pairs into rows of max(row_tokens, longest pair) tokens.

    Sequence i's next-token log-probs come back as a (batch, W) layout, W = longest - 1:
    position t holds the log-prob of its token t + 1 given tokens 0..t, and completion_mask[i, t]
    is 1 exactly where that token is a completion token.
    """
    sequences = [p + c for p, c in zip(prompts, completions)]
    width = max(len(seq) for seq in sequences)
    capacity = max(row_tokens, width)
    rows: List[List[int]] = []  # sequence indices per row
    loads: List[int] = []
    for i in sorted(range(len(sequences)), key=lambda i: -len(sequences[i])):
        row = next((r for r, load in enumerate(loads) if load + len(sequences[i]) <= capacity), None)
        if row is None:
            rows.append([])
            loads.append(0)
            row = len(rows) - 1
        rows[row].append(i)
        loads[row] += len(sequences[i])
    length = max(loads)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    position_ids = torch.zeros((len(rows), length), dtype=torch.long)
    index = torch.zeros((len(sequences), width - 1), dtype=torch.long)
    completion_mask = torch.zeros((len(sequences), width - 1), dtype=torch.float32)
    for r, members in enumerate(rows):
        offset = 0
        for i in members:
            n = len(sequences[i])
            input_ids[r, offset:offset + n] = torch.tensor(sequences[i])
            position_ids[r, offset:offset + n] = torch.arange(n)
            index[i, :n - 1] = r * (length - 1) + offset + torch.arange(n - 1)
            completion_mask[i, len(prompts[i]) - 1:n - 1] = 1
            offset += n
        position_ids[r, offset:] = torch.arange(length - offset)
    return PackedBatch(input_ids, position_ids, index, completion_mask)


@dataclass
class TokenScores:
    logprobs: torch.Tensor  # (batch, T-1) log-prob of each next token
    mask: torch.Tensor  # (batch, T-1) 1 on completion tokens
    entropy: torch.Tensor  # (batch, T-1) entropy of each next-token distribution


def completion_logprobs(model, prompts: List[List[int]], completions: List[List[int]], pad_id: int,
                        temperature: float = 1.0, entropy_grad: bool = False) -> TokenScores:
    """Score completions given prompts with one forward pass of `model` over packed rows; the
    entropy carries a gradient only with `entropy_grad` (an entropy bonus needs it, metrics do not)."""
    batch = pack(prompts, completions, pad_id)
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    all_logprobs = torch.log_softmax(logits, dim=-1)
    logprobs = all_logprobs.gather(-1, batch.input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(all_logprobs.exp() * all_logprobs).sum(-1)
    return TokenScores(logprobs.reshape(-1)[batch.index], batch.completion_mask, entropy.reshape(-1)[batch.index])


def align_per_token(values: List[List[float]], prompts: List[List[int]], width: int) -> torch.Tensor:
    """Place per-completion-token values (e.g. behaviour log-probs) at their mask positions."""
    out = torch.zeros((len(values), width), dtype=torch.float32)
    for i, (v, p) in enumerate(zip(values, prompts)):
        out[i, len(p) - 1:len(p) - 1 + len(v)] = torch.tensor(v, dtype=torch.float32)
    return out
