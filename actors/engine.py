"""Generation engines: turn prompts into sampled completions with per-token behaviour log-probs.

`GenerationEngine` is the contract a rollout worker drives (`generate`, `load_weights`);
`TransformersEngine` is the CPU engine: a KV-cached decode loop over a Hugging Face causal LM
that records, for every token, its log-prob and the weight version that produced it. Between
decode steps it calls `between_steps`, which may load newer weights: sequences in progress
continue with them (in-flight weight update). A GPU engine (vLLM) is a second class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Protocol

import torch
from transformers import DynamicCache

from rlplatform.policy import load_policy


@dataclass
class Completion:
    prompt_ids: List[int]
    completion_ids: List[int]  # up to and including EOS when the model stopped
    text: str  # decoded completion, special tokens removed
    logprobs: List[float]  # behaviour log-prob of each completion token
    versions: List[int]  # weight version that generated each completion token


class GenerationEngine(Protocol):
    version: int  # version of the weights loaded now

    def generate(self, prompts: List[str], samples_per_prompt: int, max_new_tokens: int, temperature: float,
                 between_steps: Optional[Callable[[], None]] = None) -> List[List[Completion]]: ...

    def load_weights(self, state_dict: Dict[str, torch.Tensor], version: int) -> None: ...


class TransformersEngine:
    """Batched sampling with `transformers` on CPU; temperature 0 means greedy."""

    def __init__(self, model_path: str) -> None:
        self.model, self.tokenizer = load_policy(model_path)
        self.model.eval()
        self.version = -1

    def load_weights(self, state_dict: Dict[str, torch.Tensor], version: int) -> None:
        self.model.load_state_dict(state_dict)
        self.version = version

    @torch.no_grad()
    def generate(self, prompts: List[str], samples_per_prompt: int, max_new_tokens: int, temperature: float,
                 between_steps: Optional[Callable[[], None]] = None) -> List[List[Completion]]:
        """For each prompt, `samples_per_prompt` completions (one list per prompt)."""
        encoded = self.tokenizer(prompts, return_tensors="pt", padding=True)
        input_ids = encoded["input_ids"].repeat_interleave(samples_per_prompt, dim=0)
        attention = encoded["attention_mask"].repeat_interleave(samples_per_prompt, dim=0)
        tokens, logprobs, versions = self._decode(input_ids, attention, max_new_tokens, temperature, between_steps)
        completions = [self._completion(input_ids[i], attention[i], tokens[i], logprobs[i], versions)
                       for i in range(len(input_ids))]
        return [completions[i:i + samples_per_prompt] for i in range(0, len(completions), samples_per_prompt)]

    def _decode(self, input_ids, attention, max_new_tokens, temperature, between_steps):
        """(new tokens, their log-probs) as (batch, steps) tensors, and the version of each step."""
        cache = DynamicCache()
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(input_ids=input_ids, attention_mask=attention, position_ids=positions,
                            past_key_values=cache, use_cache=True).logits[:, -1]
        done = torch.zeros(len(input_ids), dtype=torch.bool)
        tokens, logprobs, versions = [], [], []
        for step in range(max_new_tokens):
            token, logprob = _sample(logits.float(), temperature)
            token = torch.where(done, torch.full_like(token, self.tokenizer.pad_token_id), token)
            tokens.append(token)
            logprobs.append(logprob)
            versions.append(self.version)
            done |= token == self.tokenizer.eos_token_id
            if done.all() or step == max_new_tokens - 1:
                break
            if between_steps is not None:
                between_steps()
            attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            logits = self.model(input_ids=token[:, None], attention_mask=attention, position_ids=positions,
                                past_key_values=cache, use_cache=True).logits[:, -1]
        return torch.stack(tokens, dim=1), torch.stack(logprobs, dim=1), versions

    def _completion(self, input_ids, attention_mask, new_tokens, token_logprobs, versions) -> Completion:
        length = len(new_tokens)
        eos_positions = (new_tokens == self.tokenizer.eos_token_id).nonzero()
        if len(eos_positions):
            length = int(eos_positions[0]) + 1
        completion_ids = new_tokens[:length].tolist()
        return Completion(
            prompt_ids=input_ids[attention_mask.bool()].tolist(), completion_ids=completion_ids,
            text=self.tokenizer.decode(completion_ids, skip_special_tokens=True),
            logprobs=token_logprobs[:length].tolist(), versions=versions[:length])


def _sample(logits: torch.Tensor, temperature: float):
    """(token, its log-prob) per row: multinomial at `temperature`, argmax at 0."""
    if temperature > 0:
        logprobs = torch.log_softmax(logits / temperature, dim=-1)
        token = torch.multinomial(logprobs.exp(), 1).squeeze(-1)
    else:
        logprobs = torch.log_softmax(logits, dim=-1)
        token = logprobs.argmax(-1)
    return token, logprobs.gather(-1, token[:, None]).squeeze(-1)
