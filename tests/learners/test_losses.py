"""SFT loss, the KL-to-reference estimate and sequence packing, checked against hand-computed numbers
(the RL policy losses and advantages are in test_algorithms.py)."""

from __future__ import annotations

import math

import pytest
import torch

from rlplatform.learners.batching import align_per_token, pack
from rlplatform.learners.losses import reference_kl, sft_loss


def test_sft_loss_on_a_tiny_tensor():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -100.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss, metrics = sft_loss(logprobs, mask)
    # masked tokens -1, -2, -0.5: loss = (1 + 2 + 0.5) / 3 = 1.1666667
    assert loss.item() == pytest.approx(3.5 / 3)
    assert metrics == {"loss": pytest.approx(3.5 / 3), "tokens": 3.0}
    loss.backward()
    # d loss / d logprob = -1/3 on masked tokens, 0 elsewhere
    expected = torch.tensor([[-1 / 3, -1 / 3, 0.0], [-1 / 3, 0.0, 0.0]])
    assert torch.allclose(logprobs.grad, expected)


def test_sft_loss_with_empty_mask_is_zero():
    loss, metrics = sft_loss(torch.tensor([[-1.0, -2.0]]), torch.zeros(1, 2))
    assert loss.item() == 0.0 and metrics["tokens"] == 1.0  # tokens clamped to 1: no division by zero


def test_pack_masks_exactly_the_completion_positions():
    prompts = [[1, 2, 3], [6]]
    completions = [[4, 5], [7, 8, 9]]
    input_ids, mask = pack(prompts, completions, pad_id=0)
    # length max(3 + 2, 1 + 3) = 5; mask covers next-token positions 0..3
    assert input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]
    # mask[i, t] = 1 exactly where input_ids[i, t + 1] is a completion token
    assert mask.tolist() == [[0.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]]
    for i, completion in enumerate(completions):
        predicted = input_ids[i, 1:][mask[i].bool()].tolist()
        assert predicted == completion
    assert mask.sum().item() == sum(len(c) for c in completions)


def test_pack_pads_with_pad_id_and_aligns_behaviour_logprobs():
    prompts = [[1, 2, 3, 4], [5, 6]]
    completions = [[7], [8, 9]]
    input_ids, mask = pack(prompts, completions, pad_id=99)
    assert input_ids.tolist() == [[1, 2, 3, 4, 7], [5, 6, 8, 9, 99]]
    assert mask.tolist() == [[0.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0]]
    aligned = align_per_token([[-0.5], [-0.25, -1.5]], prompts, mask.shape[1])
    assert aligned.tolist() == [[0.0, 0.0, 0.0, -0.5], [0.0, -0.25, -1.5, 0.0]]
    assert ((aligned != 0).float() == mask).all()  # behaviour values sit exactly on the mask


def test_reference_kl_k3_estimate_by_hand():
    # r = log pi_ref - log pi; k3 = exp(r) - r - 1
    #   r = 0    -> 1 - 0 - 1 = 0
    #   r = ln 2 -> 2 - 0.693147 - 1 = 0.306853
    #   r = -1   -> 0.367879 + 1 - 1 = 0.367879
    logprobs = torch.tensor([[-1.0, -1.0, -1.0]])
    reference = torch.tensor([[-1.0, -1.0 + math.log(2.0), -2.0]])
    assert reference_kl(logprobs, reference).tolist()[0] == pytest.approx([0.0, 0.306853, 0.367879], abs=1e-6)


def test_completion_logprobs_of_right_padded_rows_match_each_row_scored_alone(tiny_policy):
    """No attention mask is passed: right padding must not change any completion token's log-prob."""
    from rlplatform.learners.batching import completion_logprobs
    from rlplatform.policy import load_policy

    model, _ = load_policy(tiny_policy)
    prompts, completions = [[5, 6, 7, 8, 9], [6, 7]], [[10], [11, 12, 13]]
    batched = completion_logprobs(model, prompts, completions, pad_id=0)
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        alone = completion_logprobs(model, [prompt], [completion], pad_id=0)
        assert torch.allclose(batched.logprobs[i][batched.mask[i].bool()], alone.logprobs[0][alone.mask[0].bool()],
                              atol=1e-5)
