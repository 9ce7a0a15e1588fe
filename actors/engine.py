"""Generation engines: turn prompts into sampled completions with per-token behaviour log-probs.

`GenerationEngine` is the contract a rollout worker drives (`generate`, `load_weights`);
`TransformersEngine` is the CPU engine built on Hugging Face `generate`. A GPU engine (vLLM)
is a second class with the same two methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Protocol

import torch

from rlplatform.policy import load_policy


@dataclass
class Completion:
    prompt_ids: List[int]
    completion_ids: List[int]  # up to and including EOS when the model stopped
    text: str  # decoded completion, special tokens removed
    logprobs: List[float]  # behaviour log-prob of each completion token


class GenerationEngine(Protocol):
    def generate(self, prompts: List[str], samples_per_prompt: int, max_new_tokens: int,
                 temperature: float) -> List[List[Completion]]: ...

    def load_weights(self, state_dict: Dict[str, torch.Tensor]) -> None: ...


class TransformersEngine:
    """Batched sampling with `transformers` on CPU; temperature 0 means greedy."""

    def __init__(self, model_path: str) -> None:
        self.model, self.tokenizer = load_policy(model_path)
        self.model.eval()

    def load_weights(self, state_dict: Dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state_dict)

    @torch.no_grad()
    def generate(self, prompts: List[str], samples_per_prompt: int, max_new_tokens: int,
                 temperature: float) -> List[List[Completion]]:
        """For each prompt, `samples_per_prompt` completions (one list per prompt)."""
        encoded = self.tokenizer(prompts, return_tensors="pt", padding=True)
        input_ids = encoded["input_ids"].repeat_interleave(samples_per_prompt, dim=0)
        attention_mask = encoded["attention_mask"].repeat_interleave(samples_per_prompt, dim=0)
        sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) \
            if temperature > 0 else dict(do_sample=False)
        out = self.model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens,
            output_logits=True, return_dict_in_generate=True,
            pad_token_id=self.tokenizer.pad_token_id, eos_token_id=self.tokenizer.eos_token_id,
            **sampling)
        new_tokens = out.sequences[:, input_ids.shape[1]:]
        logits = torch.stack(out.logits, dim=1).float()
        if temperature > 0:
            logits = logits / temperature
        token_logprobs = torch.log_softmax(logits, dim=-1).gather(-1, new_tokens.unsqueeze(-1)).squeeze(-1)
        completions = [self._completion(input_ids[i], attention_mask[i], new_tokens[i], token_logprobs[i])
                       for i in range(len(new_tokens))]
        return [completions[i:i + samples_per_prompt] for i in range(0, len(completions), samples_per_prompt)]

    def _completion(self, input_ids, attention_mask, new_tokens, token_logprobs) -> Completion:
        length = len(new_tokens)
        eos_positions = (new_tokens == self.tokenizer.eos_token_id).nonzero()
        if len(eos_positions):
            length = int(eos_positions[0]) + 1
        completion_ids = new_tokens[:length].tolist()
        return Completion(
            prompt_ids=input_ids[attention_mask.bool()].tolist(), completion_ids=completion_ids,
            text=self.tokenizer.decode(completion_ids, skip_special_tokens=True),
            logprobs=token_logprobs[:length].tolist())
