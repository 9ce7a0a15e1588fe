"""The transformers engine under LoRA: it loads an adapter snapshot (as streamed, through the Ray
object store) onto its base model, and the behaviour log-probs it records are the learner's
log-probs of the same tokens under the same adapters."""

from __future__ import annotations

import ray
import torch

from rlplatform.actors.engine import TransformersEngine
from rlplatform.config import LoraConfig
from rlplatform.learners.batching import completion_logprobs
from rlplatform.lora import adapter_parameters, with_adapters
from rlplatform.policy import load_policy
from rlplatform.transport.adapters import AdapterSnapshot
from rlplatform.transport.weights import from_snapshot

LORA = LoraConfig(enabled=True, rank=2, alpha=4.0, target_modules=["q_proj", "v_proj", "down_proj"])


def trained_adapters(policy_path: str):
    """The policy wrapped with adapters set to random values, as a learner would hold it after training."""
    model, tokenizer = load_policy(policy_path)
    wrapped = with_adapters(model, LORA)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in adapter_parameters(wrapped).values():
            param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return wrapped, tokenizer


def scored(model, completions, pad_id: int) -> list:
    with torch.no_grad():
        scores = completion_logprobs(model, [c.prompt_ids for c in completions],
                                     [c.completion_ids for c in completions], pad_id)
    return [row[m.bool()].tolist() for row, m in zip(scores.logprobs, scores.mask)]


def test_engine_generates_with_streamed_adapters_and_matches_the_learner_logprobs(ray_session, tiny_policy):
    learner_model, tokenizer = trained_adapters(tiny_policy)
    state = {name: p.detach() for name, p in adapter_parameters(learner_model).items()}
    snapshot = ray.get(ray.put(AdapterSnapshot.of(learner_model, state)))
    engine = TransformersEngine(tiny_policy, "cpu", lora=LORA)
    engine.load_weights(from_snapshot(snapshot), version=3)
    prompts = tokenizer(["12+34=", "5+5=", "7+1="])["input_ids"]
    completions = [c for group in engine.generate(prompts, 4, 6, 1.0) for c in group]
    assert all(c.versions == [3] * len(c.completion_ids) for c in completions)
    behaviour = [c.logprobs for c in completions]
    learner = scored(learner_model, completions, tokenizer.pad_token_id)
    worst = max(abs(a - b) for row, other in zip(behaviour, learner) for a, b in zip(row, other))
    assert worst < 1e-4
    base, _ = load_policy(tiny_policy)  # the adapters do change the policy
    unadapted = scored(base, completions, tokenizer.pad_token_id)
    assert max(abs(a - b) for row, other in zip(behaviour, unadapted) for a, b in zip(row, other)) > 1e-2
