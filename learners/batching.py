"""Turning token-id sequences into model inputs and per-token log-probs under a model.

Both the SFT and the RL step score completions given prompts, in the cheapest of three layouts
(`choose_layout`):
- packed rows: sequences back to back several to a row (first fit, longest first) with positions
  restarting at each, so attention stays within each sequence and no compute goes to padding
  when lengths vary;
- grouped rows: when many completions answer the same prompt (a GRPO group) and a group fits a
  short row, one row per distinct prompt holds the prompt once and then each of its completions,
  and an attention mask keeps every completion on its prompt and itself: one forward pass;
- shared prompts: for groups too long for one row, each distinct prompt runs once and its KV
  cache, repeated per completion, serves all of them in a second pass.
Either way only the completion positions go through the output head, a bounded number of tokens
at a time, and the log-prob of every completion token comes back in one row per sequence. Each layout tells a
mixture-of-experts policy's routing replay (`Routes`) which sequence and position each token it feeds is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache

from rlplatform.devices import to_device
from rlplatform.learners.compiled_layers import has_compiled_layers
from rlplatform.learners.head_scores import HeadScores, compute_dtype, fused_head, score_chunks
from rlplatform.learners.routing_replay import Routes
from rlplatform.policy import kv_cache_keyword

ROW_TOKENS = 64  # packed row length, unless one sequence is longer
# tokens the shared-prompt layout must save to pay for its second forward pass: about the fixed cost of a
# pass (Python, dispatch, DeepSpeed's hooks) in tokens of the demo model on one CPU core; a GRPO batch saves
# hundreds, a handful of short sequences (the parity canary) none
SHARED_PROMPT_MIN_SAVING = 64
# the longest grouped row, in units of the model's hidden size: each query of a row attends to all of it
# (masked), about 4·L·H operations per token and layer against 24·H² and more in the matmuls, so rows up to
# the hidden size keep attention under a sixth of a layer's work
GROUPED_ROW_PER_HIDDEN = 1


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # (rows, L) sequences back to back, then pad ids
    position_ids: torch.Tensor  # (rows, L) restarting at 0 with each sequence (and the padding)
    index: torch.Tensor  # (batch, W) flat index into (rows, L-1) of each sequence's next-token positions
    completion_mask: torch.Tensor  # (batch, W) 1 where that next token is a completion token
    sequence: torch.Tensor  # (rows, L) which sequence each token belongs to (-1: padding)


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
    row_ids, row_positions, row_sequences, starts = [], [], [], [0] * len(sequences)  # starts: flat offsets
    for r, members in enumerate(rows):
        ids, positions, owners = [], [], []
        for i in members:
            starts[i] = r * (length - 1) + len(ids)
            ids += sequences[i]
            positions += range(len(sequences[i]))
            owners += [i] * len(sequences[i])
        row_ids.append(ids + [pad_id] * (length - len(ids)))
        row_positions.append(positions + list(range(length - len(ids))))
        row_sequences.append(owners + [-1] * (length - len(ids)))
    index = _spans(torch.tensor(starts), torch.zeros(len(sequences), dtype=torch.long),
                   torch.tensor([len(seq) - 1 for seq in sequences]), width - 1)
    return PackedBatch(torch.tensor(row_ids), torch.tensor(row_positions), index,
                       _completion_mask(prompts, completions), torch.tensor(row_sequences))


@dataclass
class TokenScores:
    logprobs: torch.Tensor  # (batch, T-1) log-prob of each next completion token, 0 elsewhere
    mask: torch.Tensor  # (batch, T-1) 1 on completion tokens
    entropy: torch.Tensor  # (batch, T-1) entropy of each next-token distribution, 0 off completion tokens


LOGIT_CHUNK_ELEMENTS = {"cuda": 2 ** 28, "cpu": 2 ** 25}  # vocabulary logits alive at once (1 GiB / 128 MiB
# in float32): a GPU's larger chunks make fewer, fuller matmuls and fewer passes over the head's gradient


def completion_logprobs(model, prompts: List[List[int]], completions: List[List[int]], pad_id: int,
                        temperature: float = 1.0, *, entropy_grad: bool = False,
                        chunk_tokens: int = 0, token_mask: Optional[List[List[int]]] = None,
                        routes: Optional[Routes] = None) -> TokenScores:
    """Score completions given prompts in the layout `choose_layout` picks; the entropy carries a gradient
    only with `entropy_grad` (an entropy bonus needs it, metrics do not).
    `token_mask` (0/1 per completion token) keeps only some completion tokens in the mask. With `routes` (a
    mixture-of-experts policy), each forward pass's routers follow the sequences' recorded experts.

    `model` is a Hugging Face causal LM or a DeepSpeed engine around one. Its body runs once; the
    output head then projects only the completion positions, `chunk_tokens` at a time (0: as many
    as fit LOGIT_CHUNK_ELEMENTS for the device), recomputed in backward, so no full-vocabulary logits
    exist for the whole batch in either pass.
    """
    device = next(model.parameters()).device
    layout = choose_layout(model, prompts, completions)
    if layout == "grouped":
        hidden, targets, index = _grouped_forward(model, prompts, completions, pad_id, device, routes=routes)
    elif layout == "shared_prompt":
        hidden, targets, index = _shared_prompt_forward(model, prompts, completions, pad_id, device, routes=routes)
    else:
        batch = pack(prompts, completions, pad_id)
        input_ids, index = to_device(batch.input_ids, device), batch.index
        if routes is not None:
            routes.follow(batch.sequence, batch.position_ids, device)
        hidden = _final_hidden(model, input_ids=input_ids, use_cache=False, **_packed_attention(batch, device))[:, :-1]
        targets = input_ids[:, 1:]
    # where the scored tokens are, worked out on the host: selecting them by a mask on the device would make the
    # host wait for the forward pass to learn how many there are
    width = max(len(p) + len(c) for p, c in zip(prompts, completions)) - 1
    kept = _kept_positions(prompts, completions, width, token_mask)
    mask = torch.zeros(len(prompts) * width).index_fill_(0, kept, 1.0).view(len(prompts), width)
    wanted = index.view(-1)[kept]  # flat positions of the completion tokens, in (batch, T-1) mask order
    row, column = to_device(wanted // targets.shape[1], device), to_device(wanted % targets.shape[1], device)
    head = _unwrap(model).get_output_embeddings()
    elements = LOGIT_CHUNK_ELEMENTS.get(device.type, LOGIT_CHUNK_ELEMENTS["cpu"])
    chunk = chunk_tokens or max(1, elements // head.out_features)
    logprobs, entropy = chunked_token_scores(head, hidden[row, column], targets[row, column], temperature,
                                             entropy_grad, chunk_tokens=chunk)
    kept = to_device(kept, device)
    return TokenScores(_scatter(logprobs, kept, mask.shape), to_device(mask, device),
                       _scatter(entropy, kept, mask.shape))


def chunked_token_scores(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                         entropy_grad: bool, *, chunk_tokens: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(log-prob of each target, entropy of each distribution) for hidden states (N, H) under the output
    head, `chunk_tokens` rows at a time. A plain linear head goes through `HeadScores` (one autograd
    node, logits recomputed in backward); any other (adapters on the head, a ZeRO-3 partition) through
    the head module itself, each chunk's logits recomputed in backward when there are several."""
    weight = fused_head(head)
    if weight is not None:
        dtype = compute_dtype(weight)
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return HeadScores.apply(hidden, weight, targets, temperature, chunk_tokens, dtype, entropy_grad)
        return score_chunks(hidden, weight, targets, temperature, chunk_tokens, dtype=dtype)[:2]
    if hidden.shape[0] <= chunk_tokens:
        return _token_scores(head, hidden, targets, temperature, entropy_grad)
    logprobs, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        args = (head, hidden[start:start + chunk_tokens], targets[start:start + chunk_tokens], temperature,
                entropy_grad)
        if torch.is_grad_enabled():
            logprob, entropy = checkpoint(_token_scores, *args, use_reentrant=False)
        else:
            logprob, entropy = _token_scores(*args)
        logprobs.append(logprob)
        entropies.append(entropy)
    return torch.cat(logprobs), torch.cat(entropies)


def _token_scores(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                  entropy_grad: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    logits = head(hidden).float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    all_logprobs = torch.log_softmax(logits, dim=-1)
    logprobs = all_logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = -(all_logprobs.exp() * all_logprobs).sum(-1)
    return logprobs, entropy


def _scatter(values: torch.Tensor, positions: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Per-completion-token values placed at their flat `positions` in a `shape` tensor, 0 elsewhere."""
    return torch.zeros(shape.numel(), dtype=values.dtype, device=values.device).index_put((positions,), values) \
        .view(shape)


def _kept_positions(prompts: List[List[int]], completions: List[List[int]], width: int,
                    token_mask: Optional[List[List[int]]]) -> torch.Tensor:
    """Flat positions in the (batch, width) next-token layout of every scored completion token (all of them, or
    those `token_mask` keeps), in row-major order: sequence i's token j + 1 of its completion at column
    len(prompt) - 1 + j."""
    return torch.tensor([i * width + len(p) - 1 + j for i, (p, c) in enumerate(zip(prompts, completions))
                         for j in range(len(c)) if token_mask is None or token_mask[i][j]], dtype=torch.long)


def _packed_attention(batch: "PackedBatch", device: torch.device) -> dict:
    """The attention inputs of packed rows: positions restarting with each sequence (and the padding) and a causal
    mask that keeps each within its own, which Hugging Face would build from the positions alone, reading back
    from the device whether the rows are packed."""
    position_ids = to_device(batch.position_ids, device)
    sequence = (position_ids == 0).cumsum(-1)  # which sequence (or run of padding) of its row each token is
    length = position_ids.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    mask = causal & (sequence.unsqueeze(2) == sequence.unsqueeze(1))
    return {"position_ids": position_ids, "attention_mask": mask.unsqueeze(1)}


def _can_share_prompts(model) -> bool:
    """Whether the KV cache survives the forward and pays: Hugging Face layers under activation checkpointing
    drop it in training mode, and then only packed rows are correct; compiled layers would run the cache's
    passes eagerly (`compiled_layers`), so their model is scored in rows they run compiled."""
    module = _unwrap(model)
    if has_compiled_layers(module):
        return False
    return not (module.training and any(getattr(m, "gradient_checkpointing", False) for m in module.modules()))


def _unwrap(model) -> torch.nn.Module:
    """The Hugging Face model inside a DeepSpeed engine, or the model itself."""
    return getattr(model, "module", model)


def _final_hidden(model, **inputs) -> torch.Tensor:
    """The body's final hidden states (batch, L, H), from a forward through `model` itself (so a
    DeepSpeed engine does its per-forward bookkeeping) that projects no position onto the vocabulary."""
    captured = []
    body = _unwrap(model).get_decoder()
    hook = body.register_forward_hook(lambda module, args, output: captured.append(output.last_hidden_state))
    try:
        model(**inputs, logits_to_keep=torch.zeros(0, dtype=torch.long, device=inputs["input_ids"].device))
    finally:
        hook.remove()
    return captured[0]


def _completion_mask(prompts: List[List[int]], completions: List[List[int]]) -> torch.Tensor:
    width = max(len(p) + len(c) for p, c in zip(prompts, completions)) - 1
    return _span_mask(_lengths(prompts) - 1, _lengths(completions), width).float()


def _lengths(sequences: List[List]) -> torch.Tensor:
    return torch.tensor([len(seq) for seq in sequences])


def _span_mask(starts: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """(batch, width) bool: row i true on positions starts[i] .. starts[i] + lengths[i] - 1."""
    offset = torch.arange(width) - starts.unsqueeze(1)
    return (offset >= 0) & (offset < lengths.unsqueeze(1))


def _spans(values_at: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, width: int) -> torch.Tensor:
    """(batch, width) long: values_at[i] + j at position starts[i] + j for j < lengths[i], 0 elsewhere."""
    offset = torch.arange(width) - starts.unsqueeze(1)
    inside = (offset >= 0) & (offset < lengths.unsqueeze(1))
    return torch.where(inside, values_at.unsqueeze(1) + offset, torch.zeros_like(offset))


def choose_layout(model, prompts: List[List[int]], completions: List[List[int]]) -> str:
    """"grouped" where one row per distinct prompt is no longer than `GROUPED_ROW_PER_HIDDEN` hidden sizes and
    feeds fewer tokens than packed rows (the attention takes a mask: SDPA); else "shared_prompt" where it saves
    at least `SHARED_PROMPT_MIN_SAVING` tokens, the price of its second pass (and the KV cache survives the
    forward); else "packed"."""
    module = _unwrap(model)
    packed_tokens = sum(len(p) + len(c) for p, c in zip(prompts, completions))
    groups = _group_lengths(prompts, completions)
    grouped_tokens = len(groups) * max(groups)
    if (module.config._attn_implementation == "sdpa" and grouped_tokens < packed_tokens
            and max(groups) <= GROUPED_ROW_PER_HIDDEN * module.config.hidden_size):
        return "grouped"
    if _can_share_prompts(model) and _shared_prompt_tokens(prompts, completions) + SHARED_PROMPT_MIN_SAVING \
            <= packed_tokens:
        return "shared_prompt"
    return "packed"


def _group_lengths(prompts: List[List[int]], completions: List[List[int]]) -> List[int]:
    """Each distinct prompt's grouped row length: the prompt once, then every completion that answers it."""
    lengths: dict = {}
    for p, c in zip(prompts, completions):
        lengths[tuple(p)] = lengths.get(tuple(p), len(p)) + len(c)
    return list(lengths.values())


def _shared_prompt_tokens(prompts: List[List[int]], completions: List[List[int]]) -> int:
    """Tokens the shared-prompt layout feeds: distinct prompts padded alike, completions padded alike."""
    distinct = {tuple(p) for p in prompts}
    return len(distinct) * max(len(p) for p in distinct) + len(completions) * max(len(c) for c in completions)


def _shared_prompt_forward(model, prompts: List[List[int]], completions: List[List[int]], pad_id: int,
                           device: torch.device, *, routes: Optional[Routes]
                           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(final hidden states, target tokens, index on the host) with each distinct prompt run once, left-padded, and
    every completion run right-padded on a copy of its prompt's KV cache (gradients flow back through it).

    hidden[i, j] predicts completion token j of sequence i: the prompt pass's last position gives
    j = 0, the completion pass the rest. `index` places them as `pack` does: (batch, W) flat
    positions into hidden[:, :, 0], position t holding the prediction of the sequence's token t + 1.
    """
    distinct: dict = {}
    owner = torch.tensor([distinct.setdefault(tuple(p), len(distinct)) for p in prompts])
    prompt_len, completion_len = max(len(p) for p in distinct), max(len(c) for c in completions)
    prompt_ids = torch.tensor([[pad_id] * (prompt_len - len(p)) + list(p) for p in distinct])
    prompt_mask = torch.tensor([[0] * (prompt_len - len(p)) + [1] * len(p) for p in distinct])
    if routes is not None:  # each distinct prompt's tokens follow the first sequence that has it
        first = torch.tensor([owner.tolist().index(d) for d in range(len(distinct))])
        routes.follow(torch.where(prompt_mask.bool(), first[:, None], -1), prompt_mask.cumsum(-1) - 1, device)
    owner, prompt_ids, prompt_mask = (to_device(t, device) for t in (owner, prompt_ids, prompt_mask))
    positions = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    cache, cache_keyword = DynamicCache(), kv_cache_keyword(_unwrap(model))
    # 4D masks built here: from a 2D one Hugging Face would read back whether any token is padding
    causal = torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=device).tril()
    eye = torch.eye(prompt_len, dtype=torch.bool, device=device)  # the left padding sees itself
    prompt_attention = (causal & prompt_mask.bool().unsqueeze(1)) | eye
    prompt_hidden = _final_hidden(model, input_ids=prompt_ids, attention_mask=prompt_attention.unsqueeze(1),
                                  position_ids=positions, use_cache=True, **{cache_keyword: cache})[:, -1]
    cache = DynamicCache(ddp_cache_data=[(layer.keys[owner], layer.values[owner]) for layer in cache.layers])
    targets = torch.tensor([list(c) + [pad_id] * (completion_len - len(c)) for c in completions])
    index = _spans(torch.arange(len(prompts)) * completion_len, _lengths(prompts) - 1, _lengths(completions),
                   max(len(p) + len(c) for p, c in zip(prompts, completions)) - 1)
    targets = to_device(targets, device)
    # each completion token sees its prompt's tokens (not their padding) and the completion up to itself
    completion_causal = torch.ones(completion_len, completion_len, dtype=torch.bool, device=device).tril()
    attention = torch.cat([prompt_mask[owner].bool().unsqueeze(1).expand(-1, completion_len, -1),
                           completion_causal.expand(len(prompts), -1, -1)], dim=2)
    if routes is not None:
        column = torch.arange(completion_len)
        inside = column < _lengths(completions)[:, None]
        routes.follow(torch.where(inside, torch.arange(len(prompts))[:, None], -1),
                      _lengths(prompts)[:, None] + column, device)
    completion_hidden = _final_hidden(model, input_ids=targets, attention_mask=attention.unsqueeze(1),
                                      position_ids=positions[owner, -1:] + 1 + torch.arange(completion_len, device=device),
                                      use_cache=True, **{cache_keyword: cache})[:, :-1]
    return torch.cat([prompt_hidden[owner].unsqueeze(1), completion_hidden], dim=1), targets, index


def _grouped_forward(model, prompts: List[List[int]], completions: List[List[int]], pad_id: int,
                     device: torch.device, *, routes: Optional[Routes]
                     ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden states, target tokens, index on the host) from one pass over a row per distinct prompt: the prompt, then
    each of its completions at the positions that follow the prompt, under a mask that lets a completion
    token see its prompt and the completion's earlier tokens only (padding sees itself).

    The hidden states come back one per completion token, (N, 1, H) with targets (N, 1): a completion's
    first token is predicted by its prompt's last position, which every completion of the group shares.
    `index` places them as `pack` does: (batch, W), position t of sequence i holding the row of the
    prediction of its token t + 1."""
    distinct: dict = {}
    rows: List[List[int]] = []
    segments: List[List[int]] = []  # 0: the prompt, i + 1: completion i, -1: padding
    positions: List[List[int]] = []
    owners: List[List[int]] = []  # the sequence each token is of (a prompt's: the first that has it), -1: padding
    predictors: List[Tuple[int, int]] = []  # (row, column) of each completion token's prediction, in order
    for i, (p, c) in enumerate(zip(prompts, completions)):
        r = distinct.setdefault(tuple(p), len(distinct))
        if r == len(rows):
            rows.append(list(p))
            segments.append([0] * len(p))
            positions.append(list(range(len(p))))
            owners.append([i] * len(p))
        start = len(rows[r])
        rows[r] += c
        segments[r] += [i + 1] * len(c)
        positions[r] += range(len(p), len(p) + len(c))
        owners[r] += [i] * len(c)
        predictors += [(r, start + j - 1 if j else len(p) - 1) for j in range(len(c))]
    length = max(len(row) for row in rows)
    input_ids = to_device(torch.tensor([row + [pad_id] * (length - len(row)) for row in rows]), device)
    position_ids = to_device(torch.tensor([pos + list(range(len(pos), length)) for pos in positions]), device)
    segment = to_device(torch.tensor([seg + [-1] * (length - len(seg)) for seg in segments]), device)
    query, key = segment.unsqueeze(2), segment.unsqueeze(1)
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    mask = (causal & ((key == 0) | (key == query))) | torch.eye(length, dtype=torch.bool, device=device)
    if routes is not None:
        routes.follow(torch.tensor([o + [-1] * (length - len(o)) for o in owners]),
                      torch.tensor([pos + [0] * (length - len(pos)) for pos in positions]), device)
    hidden = _final_hidden(model, input_ids=input_ids, position_ids=position_ids, attention_mask=mask.unsqueeze(1),
                           use_cache=False)
    flat = to_device(torch.tensor([r * length + column for r, column in predictors]), device)
    targets = to_device(torch.tensor([t for c in completions for t in c]), device)
    counts = _lengths(completions)
    index = _spans(counts.cumsum(0) - counts, _lengths(prompts) - 1, counts,
                   max(len(p) + len(c) for p, c in zip(prompts, completions)) - 1)
    return hidden.flatten(0, 1)[flat].unsqueeze(1), targets.unsqueeze(1), index


def align_per_token(values: List[List[float]], prompts: List[List[int]], width: int) -> torch.Tensor:
    """Place per-completion-token values (e.g. behaviour log-probs) at their mask positions."""
    out = torch.zeros((len(values), width), dtype=torch.float32)
    out.view(-1)[_kept_positions(prompts, values, width, None)] = torch.tensor([x for v in values for x in v],
                                                                              dtype=torch.float32)
    return out
