"""Chunked scoring: per-token log-probs and entropies computed through the output head a few tokens
at a time (recomputed in backward) equal, in value and in parameter gradient, the plain computation
that builds every sequence's full-vocabulary logits."""

from __future__ import annotations

import pytest
import torch

from rlplatform.learners.batching import choose_layout, completion_logprobs
from rlplatform.learners import head_scores
from rlplatform.learners.compile_guard import compiling_failed
from rlplatform.learners.head_scores import HeadScores, compute_dtype, fused_head
from rlplatform.policy import enable_activation_checkpointing, load_policy
from tests.learners.layouts import LAYOUT_EXAMPLES

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


@pytest.mark.parametrize("layout", sorted(LAYOUT_EXAMPLES))
def test_chunked_scores_and_gradients_equal_the_full_vocabulary_computation(tiny_policy, layout):
    model, _ = load_policy(tiny_policy)
    prompts, completions = LAYOUT_EXAMPLES[layout]
    assert choose_layout(model, prompts, completions) == layout
    tokens = sum(len(c) for c in completions)
    # fixed per-token weights make the objective touch every log-prob and entropy differently
    generator = torch.Generator().manual_seed(0)
    logprob_weight, entropy_weight = torch.randn(tokens, generator=generator), torch.randn(tokens, generator=generator)

    # 7 tokens per chunk: the batch's completion tokens span several chunks, the last one partial
    scores = completion_logprobs(model, prompts, completions, pad_id=0, temperature=TEMPERATURE,
                                 entropy_grad=True, chunk_tokens=7)
    mask = scores.mask.bool()
    chunked = scores.logprobs[mask], scores.entropy[mask]
    assert tokens > 7 and tokens % 7
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
    prompts, completions = LAYOUT_EXAMPLES["packed"]
    scores = completion_logprobs(model, prompts, completions, pad_id=0, chunk_tokens=3)
    assert scores.logprobs.requires_grad and not scores.entropy.requires_grad


@pytest.mark.parametrize("layout,checkpointed_layout", [("grouped", "grouped"), ("shared_prompt", "packed")])
def test_activation_checkpointing_scores_prompt_groups_correctly(tiny_policy, layout, checkpointed_layout):
    """Hugging Face layers drop the KV cache under activation checkpointing in training mode, so such a
    model must get packed rows where it would share prompts' caches; a grouped row needs no cache. Same
    scores and gradients either way."""
    prompts, completions = LAYOUT_EXAMPLES[layout]

    def scored(checkpointing):
        model, _ = load_policy(tiny_policy)
        if checkpointing:
            enable_activation_checkpointing(model)
            model.train()
        assert choose_layout(model, prompts, completions) == (checkpointed_layout if checkpointing else layout)
        scores = completion_logprobs(model, prompts, completions, pad_id=0)
        return scores.logprobs.detach(), gradient(model, (scores.logprobs * scores.mask).sum())

    (plain, plain_grad), (checkpointed, checkpointed_grad) = scored(False), scored(True)
    torch.testing.assert_close(checkpointed, plain, atol=1e-5, rtol=0)
    torch.testing.assert_close(checkpointed_grad, plain_grad, atol=1e-5, rtol=1e-4)


def stock_scores(hidden, weight, targets, temperature):
    """Autograd's stock operations on the full logits: the reference for `HeadScores`."""
    logits = (hidden @ weight.t()).float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    all_logprobs = torch.log_softmax(logits, dim=-1)
    entropy = -(all_logprobs.exp() * all_logprobs).sum(-1)
    return all_logprobs.gather(-1, targets[:, None]).squeeze(-1), entropy


@pytest.fixture(params=["in place", "one expression"])
def chunk_arithmetic(request, monkeypatch):
    """Each form of the head's per-chunk arithmetic: the eager in-place code, and the expressions CUDA compiles
    (`chunk_stats`, `chunk_grad`), run here uncompiled."""
    if request.param == "one expression":
        monkeypatch.setattr(head_scores, "_fused", lambda device, fn: fn)
    return request.param


@pytest.mark.parametrize("temperature,entropy_grad", [(0.7, True), (1.0, False), (0.0, True)])
def test_fused_head_scores_equal_stock_autograd(temperature, entropy_grad, chunk_arithmetic, device="cpu"):
    """The one-node head (forward keeps log-normalisers, backward recomputes each chunk) gives the
    stock computation's values and its gradients for the hidden states and the weight."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(23, 16, generator=generator).to(device).requires_grad_()
    weight = torch.randn(50, 16, generator=generator).to(device).requires_grad_()
    targets = torch.randint(0, 50, (23,), generator=generator).to(device)
    logprob_weight, entropy_weight = (torch.randn(23, generator=generator).to(device) for _ in range(2))

    def run(scores):
        logprobs, entropy = scores
        objective = (logprobs * logprob_weight).sum()
        if entropy_grad:
            objective = objective + (entropy * entropy_weight).sum()
        grads = torch.autograd.grad(objective, (hidden, weight))
        return logprobs.detach(), entropy.detach(), *grads

    fused = run(HeadScores.apply(hidden, weight, targets, temperature, 5, torch.float32, entropy_grad))
    stock = run(stock_scores(hidden, weight, targets, temperature))
    for got, want in zip(fused, stock):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("temperature,entropy_grad", [(0.7, True), (1.0, False)])
def test_the_compiled_head_arithmetic_on_cuda_equals_stock_autograd(temperature, entropy_grad):
    test_fused_head_scores_equal_stock_autograd(temperature, entropy_grad, "compiled", device="cuda")
    assert set(head_scores._COMPILED) == {"chunk_stats", "chunk_grad"} and not compiling_failed()


def test_fused_head_under_bfloat16_autocast_tracks_float32(chunk_arithmetic):
    """Under bfloat16 autocast the head's matmuls run in bfloat16 and the softmax in float32: values
    and gradients stay within bfloat16 rounding of the float32 computation."""
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(40, 32, generator=generator, requires_grad=True)
    weight = (torch.randn(300, 32, generator=generator) * 0.1).requires_grad_()
    targets = torch.randint(0, 300, (40,), generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dtype = compute_dtype(weight)
        logprobs, _ = HeadScores.apply(hidden, weight, targets, 1.0, 16, dtype, False)
    assert dtype == torch.bfloat16 and logprobs.dtype == torch.float32
    grads = torch.autograd.grad(logprobs.sum(), (hidden, weight))
    want = stock_scores(hidden, weight, targets, 1.0)[0]
    want_grads = torch.autograd.grad(want.sum(), (hidden, weight))
    torch.testing.assert_close(logprobs.detach(), want.detach(), atol=0.05, rtol=0.02)
    for got, expected in zip(grads, want_grads):
        assert grads[0].dtype == torch.float32
        assert (got - expected).norm() / expected.norm() < 0.02


def test_the_policy_head_takes_the_fused_path(tiny_policy):
    model, _ = load_policy(tiny_policy)
    assert fused_head(model.get_output_embeddings()) is model.get_output_embeddings().weight
