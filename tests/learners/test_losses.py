"""Losses and packing checked against hand-computed numbers: group advantages, SFT NLL, the
GRPO loss with truncated importance weights and its gradient, and the completion mask."""

from __future__ import annotations

import math

import pytest
import torch

from rlplatform.learners.batching import align_per_token, pack
from rlplatform.learners.losses import PolicyLossInputs, group_advantages, grpo_loss, reference_kl, sft_loss


def test_group_advantages_std_normalised():
    advantages = group_advantages([[1.0, 0.0, 0.0, 0.0], [2.0, 4.0], [1.0, 1.0, 1.0]])
    # group 1: mean 0.25, centred [0.75, -0.25, -0.25, -0.25]
    #   population variance (0.75^2 + 3 * 0.25^2) / 4 = 0.75 / 4 = 0.1875, std = sqrt(0.1875) = 0.4330127
    #   0.75 / 0.4330127 = sqrt(3) = 1.7320508; -0.25 / 0.4330127 = -1/sqrt(3) = -0.5773503
    assert advantages[0] == pytest.approx([math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)],
                                          rel=1e-5)
    # group 2: mean 3, centred [-1, 1], std 1 -> [-1, 1]
    assert advantages[1] == pytest.approx([-1.0, 1.0], rel=1e-5)
    # group 3: all rewards equal -> centred 0, std 0, 0 / (0 + eps) = 0: no signal, no NaN
    assert advantages[2] == [0.0, 0.0, 0.0]
    # normalised groups sum to 0
    assert sum(advantages[0]) == pytest.approx(0.0, abs=1e-9)


def test_group_advantages_centred_only():
    advantages = group_advantages([[1.0, 0.0, 0.0, 0.0], [3.0, 5.0, 10.0]], std_normalize=False)
    # mean 0.25 -> [0.75, -0.25, -0.25, -0.25]; mean 6 -> [-3, -1, 4]
    assert advantages[0] == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert advantages[1] == pytest.approx([-3.0, -1.0, 4.0])


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


LOGPROBS = [[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]  # 5 completion tokens
ADVANTAGES = [0.5, -2.0]


def policy_inputs(behaviour_shift):
    """behaviour = current - shift (shift > 0: the behaviour policy was less likely)."""
    logprobs = torch.tensor(LOGPROBS, requires_grad=True)
    behaviour = torch.tensor(LOGPROBS) - torch.tensor(behaviour_shift)
    return PolicyLossInputs(logprobs, behaviour, torch.tensor(ADVANTAGES), torch.tensor(MASK))


def test_grpo_loss_on_policy():
    inputs = policy_inputs([[0.0] * 3, [0.0] * 3])
    loss, metrics = grpo_loss(inputs, clip_eps=0.2, is_cap=2.0)
    # importance weight exp(0) = 1 and ratio 1, so the loss is -(mean over masked tokens of advantage):
    #   advantages per token: 0.5, 0.5, 0.5, -2.0, -2.0 -> mean (1.5 - 4.0) / 5 = -0.5 -> loss 0.5
    assert loss.item() == pytest.approx(0.5)
    assert metrics["loss"] == pytest.approx(0.5)
    assert metrics["importance_weight_mean"] == pytest.approx(1.0)
    assert metrics["importance_weight_max"] == pytest.approx(1.0)
    assert metrics["logprob_mismatch_abs"] == pytest.approx(0.0)
    assert metrics["pg_loss"] == pytest.approx(0.5) and metrics["clip_fraction"] == 0.0
    assert "kl_to_reference" not in metrics  # no reference given
    assert metrics["tokens"] == 5.0


def test_grpo_loss_truncated_importance_weight():
    shift = [[0.1, 1.0, 0.5], [0.2, 0.0, 3.0]]
    inputs = policy_inputs(shift)
    loss, metrics = grpo_loss(inputs, clip_eps=0.2, is_cap=2.0)
    # importance = min(exp(current - behaviour), 2.0):
    #   exp(0.1) = 1.1051709, exp(1.0) = 2.7182818 -> 2.0, exp(0.5) = 1.6487213,
    #   exp(0.2) = 1.2214028, exp(0.0) = 1.0, (exp(3.0) -> 2.0, masked out)
    w = [[math.exp(0.1), 2.0, math.exp(0.5)], [math.exp(0.2), 1.0, 2.0]]
    # loss = -(0.5 * (1.1051709 + 2.0 + 1.6487213) - 2.0 * (1.2214028 + 1.0)) / 5
    #      = -(2.3769461 - 4.4428056) / 5 = 0.4131719
    expected = -(0.5 * (w[0][0] + w[0][1] + w[0][2]) - 2.0 * (w[1][0] + w[1][1])) / 5
    assert expected == pytest.approx(0.4131719, rel=1e-6)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    # mean weight over masked tokens: (1.1051709 + 2 + 1.6487213 + 1.2214028 + 1) / 5 = 1.3950590
    assert metrics["importance_weight_mean"] == pytest.approx((w[0][0] + 2.0 + w[0][2] + w[1][0] + 1.0) / 5, rel=1e-6)
    assert metrics["importance_weight_max"] == pytest.approx(2.0)  # truncated at is_cap
    # |mismatch| over masked tokens: (0.1 + 1.0 + 0.5 + 0.2 + 0.0) / 5 = 0.36
    assert metrics["logprob_mismatch_abs"] == pytest.approx(0.36, rel=1e-5)

    # a higher cap lets exp(1.0) = 2.7182818 through
    loss_capped_high, metrics_high = grpo_loss(policy_inputs(shift), clip_eps=0.2, is_cap=10.0)
    assert metrics_high["importance_weight_max"] == pytest.approx(math.e, rel=1e-6)
    assert loss_capped_high.item() == pytest.approx(expected - 0.5 * (math.e - 2.0) / 5, rel=1e-6)


@pytest.mark.parametrize("shift", [[[0.0] * 3, [0.0] * 3], [[0.1, 1.0, 0.5], [0.2, 0.0, 3.0]]])
def test_grpo_gradient(shift):
    inputs = policy_inputs(shift)
    loss, _ = grpo_loss(inputs, clip_eps=0.2, is_cap=2.0)
    loss.backward()
    importance = torch.exp(torch.tensor(shift)).clamp(max=2.0)
    advantages = torch.tensor(ADVANTAGES).unsqueeze(-1)
    mask = torch.tensor(MASK)
    # d loss / d logprob = -importance * advantage / tokens on masked tokens, 0 elsewhere
    expected = -importance * advantages / 5 * mask
    assert torch.allclose(inputs.logprobs.grad, expected, atol=1e-7)
    assert inputs.logprobs.grad[1, 2].item() == 0.0  # the masked-out token gets no gradient
    # e.g. first token: -exp(shift) * 0.5 / 5 ; token (1, 0): -exp(0.2 or 0) * (-2.0) / 5
    assert inputs.logprobs.grad[0, 0].item() == pytest.approx(-math.exp(shift[0][0]) * 0.5 / 5, rel=1e-6)
    assert inputs.logprobs.grad[1, 0].item() == pytest.approx(math.exp(shift[1][0]) * 2.0 / 5, rel=1e-6)


def test_pack_masks_exactly_the_completion_positions():
    prompts = [[1, 2, 3], [6]]
    completions = [[4, 5], [7, 8, 9]]
    input_ids, attention, mask = pack(prompts, completions, pad_id=0)
    # length max(3 + 2, 1 + 3) = 5; mask covers next-token positions 0..3
    assert input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]
    assert attention.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # mask[i, t] = 1 exactly where input_ids[i, t + 1] is a completion token
    assert mask.tolist() == [[0.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 0.0]]
    for i, completion in enumerate(completions):
        predicted = input_ids[i, 1:][mask[i].bool()].tolist()
        assert predicted == completion
    assert mask.sum().item() == sum(len(c) for c in completions)


def test_pack_pads_with_pad_id_and_aligns_behaviour_logprobs():
    prompts = [[1, 2, 3, 4], [5, 6]]
    completions = [[7], [8, 9]]
    input_ids, attention, mask = pack(prompts, completions, pad_id=99)
    assert input_ids.tolist() == [[1, 2, 3, 4, 7], [5, 6, 8, 9, 99]]
    assert attention.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
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


def test_grpo_loss_adds_kl_penalty_and_reports_it():
    # one completion of 2 tokens, advantage 0, so the policy-gradient term is 0 and the loss is
    # kl_coef * mean k3 = 0.5 * (0 + 0.306853) / 2 = 0.0767132
    logprobs = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    reference = torch.tensor([[-1.0, -1.0 + math.log(2.0)]])
    inputs = PolicyLossInputs(logprobs, logprobs.detach().clone(), torch.tensor([0.0]), torch.ones(1, 2), reference)
    loss, metrics = grpo_loss(inputs, clip_eps=0.2, is_cap=2.0, kl_coef=0.5)
    assert metrics["pg_loss"] == pytest.approx(0.0, abs=1e-7)
    assert metrics["kl_to_reference"] == pytest.approx(0.306853 / 2, abs=1e-6)
    assert loss.item() == pytest.approx(0.0767132, abs=1e-6)
