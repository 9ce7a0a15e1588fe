"""SFT loss, the KL-to-reference estimate and sequence packing, checked against hand-computed numbers
(the RL policy losses and advantages are in test_algorithms.py)."""

from __future__ import annotations

import math

import pytest
import torch

from rlplatform.learners.batching import align_per_token, pack
from rlplatform.learners.losses import reference_kl, sft_loss
from tests.learners.layouts import LAYOUT_EXAMPLES


def test_sft_loss_on_a_tiny_tensor():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -100.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, metrics = sft_loss(logprobs, mask)
    metrics = {k: float(v) for k, v in metrics.items()}
    # masked tokens -1, -2, -0.5: loss = (1 + 2 + 0.5) / 3 = 1.1666667
    assert loss.item() == pytest.approx(3.5 / 3)
    assert metrics == {"loss": pytest.approx(3.5 / 3), "tokens": 3.0}
    loss.backward()
    # d loss / d logprob = -1/3 on masked tokens, 0 elsewhere
    expected = torch.tensor([[-1 / 3, -1 / 3, 0.0], [-1 / 3, 0.0, 0.0]])
    assert torch.allclose(logprobs.grad, expected)


def test_sft_loss_with_empty_mask_is_zero():
    loss, metrics = sft_loss(torch.tensor([[-1.0, -2.0]]), torch.zeros(1, 2))
    assert loss.item() == 0.0 and float(metrics["tokens"]) == 0.0  # the denominator is clamped to 1: no division by zero


def test_sft_loss_divides_by_a_given_denominator():
    # 2 tokens of log-probs -1 and -2 on this rank; 6 tokens over all ranks, 2 ranks: 3 / (6 / 2) = 1
    loss, metrics = sft_loss(torch.tensor([[-1.0, -2.0]]), torch.ones(1, 2), denominator=3.0)
    assert loss.item() == pytest.approx(1.0) and float(metrics["tokens"]) == 2.0


def test_pack_puts_sequences_back_to_back_and_indexes_exactly_the_completion_positions():
    prompts = [[1, 2, 3], [6]]
    completions = [[4, 5], [7, 8, 9]]
    batch = pack(prompts, completions, pad_id=0, row_tokens=16)
    # one row: the longer pair first, positions restarting at each sequence and at the padding
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    # W = longest - 1 = 4; mask[i, t] = 1 exactly where token t + 1 of sequence i is a completion token
    assert batch.completion_mask.tolist() == [[0.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]]
    next_tokens = batch.input_ids[:, 1:].reshape(-1)
    for i, completion in enumerate(completions):
        assert next_tokens[batch.index[i]][batch.completion_mask[i].bool()].tolist() == completion


def test_pack_starts_a_new_row_when_full_and_pads_with_pad_id():
    prompts = [[1, 2, 3, 4], [5, 6], [10, 11]]
    completions = [[7], [8, 9], [12]]
    batch = pack(prompts, completions, pad_id=99, row_tokens=5)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 7], [5, 6, 8, 9, 99], [10, 11, 12, 99, 99]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    assert batch.completion_mask.tolist() == [[0.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]]
    aligned = align_per_token([[-0.5], [-0.25, -1.5], [-2.0]], prompts, batch.completion_mask.shape[1])
    assert aligned.tolist() == [[0.0, 0.0, 0.0, -0.5], [0.0, -0.25, -1.5, 0.0], [0.0, -2.0, 0.0, 0.0]]
    assert ((aligned != 0).float() == batch.completion_mask).all()  # behaviour values sit exactly on the mask


def test_reference_kl_k3_estimate_by_hand():
    # r = log pi_ref - log pi; k3 = exp(r) - r - 1
    #   r = 0    -> 1 - 0 - 1 = 0
    #   r = ln 2 -> 2 - 0.693147 - 1 = 0.306853
    #   r = -1   -> 0.367879 + 1 - 1 = 0.367879
    logprobs = torch.tensor([[-1.0, -1.0, -1.0]])
    reference = torch.tensor([[-1.0, -1.0 + math.log(2.0), -2.0]])
    assert reference_kl(logprobs, reference).tolist()[0] == pytest.approx([0.0, 0.306853, 0.367879], abs=1e-6)


@pytest.mark.parametrize("layout", sorted(LAYOUT_EXAMPLES))
def test_scores_and_gradients_match_each_sequence_scored_alone(tiny_policy, layout):
    """Sequences sharing a row, or a prompt's KV cache, must not attend to each other: every completion
    token's log-prob, and the gradient of their sum, is what the sequence alone gives."""
    from rlplatform.learners.batching import choose_layout, completion_logprobs
    from rlplatform.policy import load_policy

    model, _ = load_policy(tiny_policy)
    prompts, completions = LAYOUT_EXAMPLES[layout]
    assert choose_layout(model, prompts, completions) == layout

    def scored(pairs):
        model.zero_grad()
        scores = completion_logprobs(model, [p for p, _ in pairs], [c for _, c in pairs], pad_id=0)
        (scores.logprobs * scores.mask).sum().backward()
        grad = torch.cat([p.grad.flatten() for p in model.parameters()])
        return [row[m.bool()] for row, m in zip(scores.logprobs.detach(), scores.mask)], grad

    together, together_grad = scored(list(zip(prompts, completions)))
    alone_grad = 0
    for pair, scores in zip(zip(prompts, completions), together):
        (alone,), grad = scored([pair])
        alone_grad = alone_grad + grad
        torch.testing.assert_close(scores, alone, atol=1e-5, rtol=0)
    torch.testing.assert_close(together_grad, alone_grad, atol=1e-4, rtol=1e-3)
