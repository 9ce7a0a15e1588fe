"""What every engine's decode loop shares: the sequences it carries and the completions it returns.

A `Row` is one sequence being decoded (its prompt, its tokens so far with their behaviour log-probs and
weight versions, and for a mixture-of-experts policy the experts of every token fed); `completion` turns a finished row into the `Completion` a rollout worker receives, and
`sample` draws each row's next token from its logits at the row's own temperature.
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Dict, Hashable, List, Tuple

import torch

from rlplatform.transport.routed_experts import encode_routing


@dataclass
class Completion:
    prompt_ids: List[int]
    completion_ids: List[int]  # up to and including EOS when the model stopped
    text: str  # decoded completion, special tokens removed
    logprobs: List[float]  # behaviour log-prob of each completion token
    versions: List[int]  # weight version that generated each completion token
    _: KW_ONLY
    completion_mask: List[int] = field(default_factory=list)  # multi-turn: 1 model token, 0 observation (Sample's)
    episode: Dict[str, Any] = field(default_factory=dict)  # multi-turn: per-episode fields for the sample's row
    routed_experts: bytes = b""  # a mixture-of-experts policy: each fed token's experts (Sample's; none recorded: empty)


@dataclass
class Row:
    key: Hashable  # the caller's tag for this sequence
    prompt_ids: List[int]
    max_new_tokens: int
    temperature: float
    tokens: List[int] = field(default_factory=list)
    _: KW_ONLY
    logprobs: List[float] = field(default_factory=list)
    versions: List[int] = field(default_factory=list)
    routed: List[torch.Tensor] = field(default_factory=list)  # the experts of the tokens fed so far, (tokens, layers, k) pieces


def completion(row: Row, tokenizer) -> Completion:
    """The finished row as a completion, its text decoded with special tokens removed."""
    return Completion(prompt_ids=row.prompt_ids, completion_ids=row.tokens,
                      text=tokenizer.decode(row.tokens, skip_special_tokens=True),
                      logprobs=row.logprobs, versions=row.versions, routed_experts=encode_routing(row.routed))


def sample(logits: torch.Tensor, temperatures: torch.Tensor, any_sampled: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """(token, its log-prob) per row: multinomial at the row's temperature, argmax where it is 0.
    `any_sampled`: whether some temperature is above 0 (known on the host, so the device is not asked)."""
    sampled = temperatures > 0
    logprobs = torch.log_softmax(logits / torch.where(sampled, temperatures, 1.0)[:, None], dim=-1)
    token = logprobs.argmax(-1)
    if any_sampled:
        token = torch.where(sampled, torch.multinomial(logprobs.exp(), 1).squeeze(-1), token)
    return token, logprobs.gather(-1, token[:, None]).squeeze(-1)
