"""Chunked scoring: per-token log-probs and entropies computed through the output head a few tokens
at a time (recomputed in backward) equal, in value and in parameter gradient, the plain computation
that builds every sequence's full-vocabulary logits."""

from __future__ import annotations

import pytest
import torch

from rlplatform.learners.batching import _shared_prompt_tokens, completion_logprobs
from rlplatform.policy import enable_activation_checkpointing, load_policy

GROUPS = {
    "packed": ([[5, 6, 7, 8, 9], [6, 7], [8], [9, 10, 11]], [[10], [11, 12, 13], [5, 5, 5, 5], [7, 8]]),
    "shared_prompt": ([[5, 6, 7, 8, 9]] * 3 + [[6, 7]] * 3, [[10], [11, 12], [13, 5, 5], [7], [8, 8], [9, 10, 11]]),
}
TEMPERATURE = 0.7


def plain_scores(model, prompt, completion):
    """(log-probs, entropies) of one completion's tokens from the model's full logits, at TEMPERATURE."""
    ids = torch.tensor([prompt + completion])
    logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float() / TEMPERATURE
    all_logprobs = torch.log_softmax(logits, dim=-1)
    entropy = -(all_logprobs.exp() * all_logprobs).sum(-1)
    return all_logprobs.gather(-1, torch.tensor(completion).unsqueeze(-1)).squeeze(-1), entropy


def gradient(model, objective):
    model.zero_grad()
    objective.backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("layout", sorted(GROUPS))
def test_chunked_scores_and_gradients_equal_the_full_vocabulary_computation(tiny_policy, layout):
    model, _ = load_policy(tiny_policy)
    prompts, completions = GROUPS[layout]
    packed_tokens = sum(len(p) + len(c) for p, c in zip(prompts, completions))
    assert (_shared_prompt_tokens(prompts, completions) < packed_tokens) == (layout == "shared_prompt")
    tokens = sum(len(c) for c in completions)
    # fixed per-token weights make the objective touch every log-prob and entropy differently
    generator = torch.Generator().manual_seed(0)
    logprob_weight, entropy_weight = torch.randn(tokens, generator=generator), torch.randn(tokens, generator=generator)

    # 7 tokens per chunk: the batch's completion tokens span several chunks, the last one partial
    scores = completion_logprobs(model, prompts, completions, pad_id=0, temperature=TEMPERATURE,
                                 entropy_grad=True, chunk_tokens=7)
    mask = scores.mask.bool()
    chunked = scores.logprobs[mask], scores.entropy[mask]
    assert 7 < tokens < 14
    chunked_grad = gradient(model, (chunked[0] * logprob_weight).sum() + (chunked[1] * entropy_weight).sum())

    plain = [torch.cat(parts) for parts in zip(*(plain_scores(model, p, c) for p, c in zip(prompts, completions)))]
    plain_grad = gradient(model, (plain[0] * logprob_weight).sum() + (plain[1] * entropy_weight).sum())

    # float32 throughout; only summation order differs between the two computations
    torch.testing.assert_close(chunked[0].detach(), plain[0].detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked[1].detach(), plain[1].detach(), atol=1e-5, rtol=0)
    torch.testing.assert_close(chunked_grad, plain_grad, atol=1e-5, rtol=1e-4)
    assert (scores.logprobs[~mask] == 0).all() and (scores.entropy[~mask] == 0).all()


def test_entropy_carries_no_gradient_unless_asked(tiny_policy):
    model, _ = load_policy(tiny_policy)
    prompts, completions = GROUPS["packed"]
    scores = completion_logprobs(model, prompts, completions, pad_id=0, chunk_tokens=3)
    assert scores.logprobs.requires_grad and not scores.entropy.requires_grad


def test_activation_checkpointing_scores_shared_prompt_groups_correctly(tiny_policy):
    """Hugging Face layers drop the KV cache under activation checkpointing in training mode, so such a
    model must get packed rows even where sharing prompts is cheaper: same scores and gradients."""
    prompts, completions = GROUPS["shared_prompt"]

    def scored(checkpointing):
        model, _ = load_policy(tiny_policy)
        if checkpointing:
            enable_activation_checkpointing(model)
            model.train()
        scores = completion_logprobs(model, prompts, completions, pad_id=0)
        return scores.logprobs.detach(), gradient(model, (scores.logprobs * scores.mask).sum())

    (plain, plain_grad), (checkpointed, checkpointed_grad) = scored(False), scored(True)
    torch.testing.assert_close(checkpointed, plain, atol=1e-5, rtol=0)
    torch.testing.assert_close(checkpointed_grad, plain_grad, atol=1e-5, rtol=1e-4)
