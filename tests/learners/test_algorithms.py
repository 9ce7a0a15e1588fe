"""Algorithm components checked against hand-computed numbers: GRPO, RLOO and REINFORCE++
advantages, the three off-policy corrections, policy_loss under each correction and aggregation
(values, gradients, clip fraction), the entropy bonus and the auxiliary SFT loss."""

from __future__ import annotations

import math

import pytest
import torch

from rlplatform.learners.algorithms import (ADVANTAGE_ESTIMATORS, AGGREGATIONS, CORRECTIONS, decoupled_ppo,
                                            distillation_signal,
                                            entropy_bonus, grpo_advantages, on_policy, policy_loss,
                                            reinforce_pp_advantages, rloo_advantages, sft_auxiliary_loss,
                                            truncated_is)

REWARDS = [[1.0, 0.0, 0.0], [2.0, 4.0, 6.0]]


def test_registries_name_every_variant():
    assert ADVANTAGE_ESTIMATORS == {"grpo": grpo_advantages, "rloo": rloo_advantages,
                                    "reinforce_pp": reinforce_pp_advantages}
    assert CORRECTIONS == {"on_policy": on_policy, "truncated_is": truncated_is, "decoupled_ppo": decoupled_ppo}
    assert set(AGGREGATIONS) == {"token_mean", "sequence_mean", "fixed_length"}


def test_grpo_advantages_per_group_std():
    advantages = grpo_advantages(REWARDS + [[3.0, 3.0]])
    # group 1: mean 1/3, centred [2/3, -1/3, -1/3], population var (4/9 + 1/9 + 1/9) / 3 = 2/9,
    #   std sqrt(2)/3 = 0.4714045 -> [sqrt(2), -1/sqrt(2), -1/sqrt(2)] = [1.4142136, -0.7071068, -0.7071068]
    assert advantages[0] == pytest.approx([math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)], rel=1e-5)
    # group 2: mean 4, centred [-2, 0, 2], var 8/3, std 1.6329932 -> [-1.2247449, 0, 1.2247449]
    assert advantages[1] == pytest.approx([-math.sqrt(1.5), 0.0, math.sqrt(1.5)], rel=1e-5)
    # equal rewards: 0 / (0 + eps) = 0, no NaN
    assert advantages[2] == [0.0, 0.0]


def test_grpo_advantages_centred_only():
    # means 1/3 and 4: [2/3, -1/3, -1/3] and [-2, 0, 2]
    advantages = grpo_advantages(REWARDS, std_normalize=False)
    assert advantages[0] == pytest.approx([2 / 3, -1 / 3, -1 / 3], abs=1e-12)
    assert advantages[1] == pytest.approx([-2.0, 0.0, 2.0], abs=1e-12)


def test_rloo_baseline_excludes_self():
    advantages = rloo_advantages(REWARDS)
    # [1, 0, 0]: baselines mean(0, 0) = 0, mean(1, 0) = 0.5, mean(1, 0) = 0.5 -> [1, -0.5, -0.5]
    assert advantages[0] == pytest.approx([1.0, -0.5, -0.5], abs=1e-12)
    # [2, 4, 6]: baselines mean(4, 6) = 5, mean(2, 6) = 4, mean(2, 4) = 3 -> [-3, 0, 3]
    assert advantages[1] == pytest.approx([-3.0, 0.0, 3.0], abs=1e-12)
    # equals G/(G-1) x (r - group mean): 3/2 x 2/3 = 1 for the first completion
    assert advantages[0][0] == pytest.approx(1.5 * (1.0 - 1 / 3), abs=1e-12)


def test_rloo_rejects_a_group_of_one():
    with pytest.raises(ValueError, match="group 1 has 1 reward"):
        rloo_advantages([[1.0, 0.0], [1.0]])


def test_reinforce_pp_normalises_across_groups():
    advantages = reinforce_pp_advantages(REWARDS)
    # group-centred: [2/3, -1/3, -1/3] and [-2, 0, 2]; batch mean 0,
    # batch var (4/9 + 1/9 + 1/9 + 4 + 0 + 4) / 6 = (2/3 + 8) / 6 = 13/9, std sqrt(13)/3 = 1.2018504
    #   2/3 / std = 2/sqrt(13) = 0.5547002; 2 / std = 6/sqrt(13) = 1.6641006
    root13 = math.sqrt(13)
    assert advantages[0] == pytest.approx([2 / root13, -1 / root13, -1 / root13], rel=1e-5)
    assert advantages[1] == pytest.approx([-6 / root13, 0.0, 6 / root13], rel=1e-5)
    flat = torch.tensor(advantages[0] + advantages[1], dtype=torch.float64)
    assert flat.mean().item() == pytest.approx(0.0, abs=1e-9)
    assert flat.std(unbiased=False).item() == pytest.approx(1.0, abs=1e-5)
    # per-group GRPO would scale group 2 to unit std on its own (1.2247449), not 1.6641006
    assert advantages[1][2] != pytest.approx(grpo_advantages(REWARDS)[1][2], rel=1e-2)


# Two completions of 3 and 2 tokens (the third token of completion 2 is padding).
LOGPROBS = [[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
ADVANTAGES = [0.5, -2.0]
LOG_RATIO = [[0.0, 0.5, -0.5], [0.1, -0.5, 0.0]]  # log pi_theta - log pi_prox (after minibatch updates)
SHIFT = [[1.0, 0.1, 0.5], [0.2, 0.0, 3.0]]  # log pi_prox - log pi_behaviour (staleness)
# ratio r = exp(LOG_RATIO) = [[1, 1.6487213, 0.6065307], [1.1051709, 0.6065307, 1]]; clip range [0.8, 1.2]
# surrogate min(r A, clip(r) A) per masked token:
#   (0,0) r 1,          A 0.5  -> 0.5                       unclipped
#   (0,1) r 1.6487 > 1.2, A 0.5 -> min(0.8244, 0.6) = 0.6   clipped branch selected: no gradient
#   (0,2) r 0.6065 < 0.8, A 0.5 -> min(0.3033, 0.4) = 0.3033 ratio out of range but unclipped branch wins
#   (1,0) r 1.1052,     A -2   -> -2.2103418                unclipped
#   (1,1) r 0.6065 < 0.8, A -2 -> min(-1.2131, -1.6) = -1.6 clipped branch selected: no gradient
SURROGATE = [0.5, 0.6, 0.5 * math.exp(-0.5), -2 * math.exp(0.1), -1.6]
CLIPPED_TOKENS = [(0, 1), (1, 1)]


def loss_inputs():
    """(logprobs with grad, proximal, behaviour, advantages, mask) built from the tables above."""
    logprobs = torch.tensor(LOGPROBS, requires_grad=True)
    proximal = torch.tensor(LOGPROBS) - torch.tensor(LOG_RATIO)
    behaviour = proximal - torch.tensor(SHIFT)
    return logprobs, proximal, behaviour, torch.tensor(ADVANTAGES), torch.tensor(MASK)


def test_on_policy_weight_is_exactly_one():
    _, proximal, behaviour, _, _ = loss_inputs()
    weight = on_policy(proximal, behaviour, cap=2.0)
    assert torch.equal(weight, torch.ones(2, 3)) and not weight.requires_grad


def test_truncated_is_caps_at_cap():
    proximal = torch.tensor([[0.0, 0.0, 0.0]], requires_grad=True)
    behaviour = torch.tensor([[-3.0, 1.0, -0.5]])
    weight = truncated_is(proximal, behaviour, cap=2.0)
    # exp(3) = 20.09 -> 2; exp(-1) = 0.3678794 kept; exp(0.5) = 1.6487213 kept
    assert weight.tolist()[0] == pytest.approx([2.0, math.exp(-1.0), math.exp(0.5)], rel=1e-6)
    assert not weight.requires_grad  # a constant weight, even if proximal carries grad
    assert truncated_is(proximal, behaviour, cap=100.0)[0, 0].item() == pytest.approx(math.exp(3.0), rel=1e-6)


def test_decoupled_ppo_weight_drops_tokens_above_cap():
    proximal = torch.tensor([[0.0, 0.0, 0.0]], requires_grad=True)
    behaviour = torch.tensor([[-3.0, 1.0, -0.5]])
    # exp(3) = 20.09 > 2 -> 0 (dropped, not truncated); exp(-1), exp(0.5) kept
    assert decoupled_ppo(proximal, behaviour, cap=2.0).tolist()[0] == pytest.approx(
        [0.0, math.exp(-1.0), math.exp(0.5)], rel=1e-6)
    uncapped = decoupled_ppo(proximal, behaviour, cap=math.inf)
    assert uncapped[0, 0].item() == pytest.approx(math.exp(3.0), rel=1e-6) and not uncapped.requires_grad


def test_policy_loss_on_policy_value_and_clip_fraction():
    loss, metrics = policy_loss(*loss_inputs(), correction="on_policy")
    metrics = {k: float(v) for k, v in metrics.items()}
    # -(0.5 + 0.6 + 0.3032653 - 2.2103418 - 1.6) / 5 = 2.4070765 / 5 = 0.4814153
    assert loss.item() == pytest.approx(0.4814153, rel=1e-6)
    assert metrics["pg_loss"] == pytest.approx(0.4814153, rel=1e-6)
    # (0,1) and (1,1) clipped and selected; (0,2) is out of range but its unclipped branch wins: 2 / 5
    assert metrics["clip_fraction"] == pytest.approx(0.4)
    assert metrics["importance_weight_mean"] == 1.0 and metrics["importance_weight_max"] == 1.0
    # |log pi_prox - log pi_behaviour| over masked tokens: (1 + 0.1 + 0.5 + 0.2 + 0) / 5 = 0.36
    assert metrics["logprob_mismatch_abs"] == pytest.approx(0.36, rel=1e-5)


def test_decoupled_ppo_loss_value_and_gradient():
    logprobs, *rest = loss_inputs()
    loss, metrics = policy_loss(logprobs, *rest, correction="decoupled_ppo", is_cap=math.inf)
    metrics = {k: float(v) for k, v in metrics.items()}
    # w = exp(SHIFT) on masked tokens: [e^1, e^0.1, e^0.5, e^0.2, 1] = [2.7182818, 1.1051709, 1.6487213, 1.2214028, 1]
    # w x surrogate: 1.3591409, 0.6631026, 0.5 (= e^0.5 x 0.5 e^-0.5), -2.6997176 (= -2 e^0.3), -1.6
    # loss = -(1.3591409 + 0.6631026 + 0.5 - 2.6997176 - 1.6) / 5 = 1.7774741 / 5 = 0.3554948
    assert loss.item() == pytest.approx(0.3554948, rel=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(0.4)
    # importance mean (2.7182818 + 1.1051709 + 1.6487213 + 1.2214028 + 1) / 5 = 1.5387154, max e
    assert metrics["importance_weight_mean"] == pytest.approx(1.5387154, rel=1e-6)
    assert metrics["importance_weight_max"] == pytest.approx(math.e, rel=1e-6)
    loss.backward()
    # d loss / d logprob_t = -w r A / 5 on unclipped-branch tokens, 0 where the clipped branch is selected:
    #   (0,0): -e x 1 x 0.5 / 5 = -0.2718282     (0,2): -e^0.5 x e^-0.5 x 0.5 / 5 = -0.1
    #   (1,0): -e^0.2 x e^0.1 x (-2) / 5 = 2 e^0.3 / 5 = 0.5399435   (0,1), (1,1) clipped, (1,2) masked: 0
    expected = torch.tensor([[-math.e * 0.5 / 5, 0.0, -0.1], [2 * math.exp(0.3) / 5, 0.0, 0.0]])
    assert torch.allclose(logprobs.grad, expected, atol=1e-6)
    for row, column in CLIPPED_TOKENS:
        assert logprobs.grad[row, column].item() == 0.0


def test_decoupled_ppo_cap_drops_the_stale_token():
    logprobs, *rest = loss_inputs()
    loss, metrics = policy_loss(logprobs, *rest, correction="decoupled_ppo", is_cap=2.0)
    metrics = {k: float(v) for k, v in metrics.items()}
    # token (0,0) has w = e > 2: dropped. loss = -(0.6631026 + 0.5 - 2.6997176 - 1.6) / 5 = 0.6273230
    assert loss.item() == pytest.approx(0.6273230, rel=1e-6)
    # weights [0, 1.1051709, 1.6487213, 1.2214028, 1]: mean 4.9752950 / 5 = 0.9950590
    assert metrics["importance_weight_mean"] == pytest.approx(0.9950590, rel=1e-6)
    loss.backward()
    assert logprobs.grad[0, 0].item() == 0.0  # dropped token: no gradient
    assert logprobs.grad[1, 0].item() == pytest.approx(2 * math.exp(0.3) / 5, rel=1e-6)


def test_truncated_is_loss_truncates_the_stale_token():
    loss, metrics = policy_loss(*loss_inputs(), correction="truncated_is", is_cap=2.0)
    metrics = {k: float(v) for k, v in metrics.items()}
    # token (0,0) weight min(e, 2) = 2: 2 x 0.5 = 1. loss = -(1 + 0.6631026 + 0.5 - 2.6997176 - 1.6) / 5 = 0.4273230
    assert loss.item() == pytest.approx(0.4273230, rel=1e-6)
    # weights [2, 1.1051709, 1.6487213, 1.2214028, 1]: mean 6.9752950 / 5 = 1.3950590, max 2
    assert metrics["importance_weight_mean"] == pytest.approx(1.3950590, rel=1e-6)
    assert metrics["importance_weight_max"] == pytest.approx(2.0)


@pytest.mark.parametrize("aggregation, max_tokens, expected", [
    # -(0.5 + 0.6 + 0.3032653 - 2.2103418 - 1.6) / 5 tokens = 0.4814153
    ("token_mean", None, 0.4814153),
    # completion means 1.4032653 / 3 = 0.4677551 and -3.8103418 / 2 = -1.9051709; -(mean of both) = 0.7187079
    ("sequence_mean", None, 0.7187079),
    # 2.4070765 / (2 completions x 4 max tokens) = 0.3008846
    ("fixed_length", 4, 0.3008846),
])
def test_aggregations_on_completions_of_different_lengths(aggregation, max_tokens, expected):
    loss, _ = policy_loss(*loss_inputs(), correction="on_policy", aggregation=aggregation, max_tokens=max_tokens)
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_sequence_mean_gradient_weights_tokens_by_completion_length():
    logprobs, *rest = loss_inputs()
    loss, _ = policy_loss(logprobs, *rest, correction="on_policy", aggregation="sequence_mean")
    loss.backward()
    # d loss / d logprob_t = -r A / (2 completions x length): (0,0) -1 x 0.5 / 6 = -0.0833333;
    #   (0,2) -e^-0.5 x 0.5 / 6 = -0.0505442; (1,0) e^0.1 x 2 / 4 = 0.5525855
    expected = torch.tensor([[-0.5 / 6, 0.0, -0.5 * math.exp(-0.5) / 6], [2 * math.exp(0.1) / 4, 0.0, 0.0]])
    assert torch.allclose(logprobs.grad, expected, atol=1e-6)


def test_policy_loss_rejects_unknown_names_and_missing_max_tokens():
    with pytest.raises(ValueError, match="unknown correction 'tis'.*truncated_is"):
        policy_loss(*loss_inputs(), correction="tis")
    with pytest.raises(ValueError, match="unknown aggregation"):
        policy_loss(*loss_inputs(), aggregation="mean")
    with pytest.raises(ValueError, match="max_tokens > 0"):
        policy_loss(*loss_inputs(), aggregation="fixed_length")


def test_entropy_bonus_value_and_gradient_sign():
    entropy = torch.tensor([[0.5, 1.0, 2.0], [1.5, 0.2, 9.0]], requires_grad=True)
    mask = torch.tensor(MASK)
    bonus = entropy_bonus(entropy, mask, coef=0.01)
    # token-mean entropy (0.5 + 1 + 2 + 1.5 + 0.2) / 5 = 1.04 -> term -0.01 x 1.04 = -0.0104
    assert bonus.item() == pytest.approx(-0.0104, rel=1e-6)
    bonus.backward()
    # d term / d entropy_t = -0.01 / 5 = -0.002 < 0 on masked tokens: more entropy, lower loss
    assert torch.allclose(entropy.grad, torch.tensor([[-0.002] * 3, [-0.002, -0.002, 0.0]]), atol=1e-9)
    assert entropy_bonus(entropy.detach() + 1.0, mask, coef=0.01).item() < bonus.item()


def test_sft_auxiliary_loss_value_and_gradient():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -100.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    loss = sft_auxiliary_loss(logprobs, mask, coef=0.1)
    # NLL of masked tokens (1 + 2 + 0.5) / 3 = 1.1666667 -> 0.1 x 1.1666667 = 0.1166667
    assert loss.item() == pytest.approx(0.35 / 3, rel=1e-6)
    loss.backward()
    # d loss / d logprob = -0.1 / 3 = -0.0333333 on masked tokens
    assert torch.allclose(logprobs.grad, torch.tensor([[-0.1 / 3, -0.1 / 3, 0.0], [-0.1 / 3, 0.0, 0.0]]), atol=1e-8)


def test_the_distillation_signal_on_a_three_token_vocabulary_by_hand():
    """coef x (log teacher - log student) per sampled token; its mean under the student is -coef x KL(student ||
    teacher), and as a per-token advantage in the policy loss its gradient is exactly coef x the gradient of that
    reverse KL (every token of the vocabulary enumerated, weighted by the student's probability)."""
    student, teacher = torch.tensor([0.5, 0.3, 0.2]).log(), torch.tensor([0.2, 0.5, 0.3]).log()
    signal = distillation_signal(teacher, student, coef=2.0)
    torch.testing.assert_close(signal, torch.tensor([2 * math.log(0.2 / 0.5), 2 * math.log(0.5 / 0.3),
                                                     2 * math.log(0.3 / 0.2)]))
    kl = 0.5 * math.log(0.5 / 0.2) + 0.3 * math.log(0.3 / 0.5) + 0.2 * math.log(0.2 / 0.3)  # 0.2238
    assert (student.exp() * signal).sum().item() == pytest.approx(-2.0 * kl, abs=1e-6)

    logits = torch.tensor([0.3, -0.2, 0.5], requires_grad=True)
    logprobs = torch.log_softmax(logits, -1)
    expected, = torch.autograd.grad(2.0 * (logprobs.exp() * (logprobs - teacher)).sum(), logits, retain_graph=True)
    total = 0.0
    for token in range(3):  # one single-token sample per token, on-policy (ratio 1)
        logprob = logprobs[token].view(1, 1)
        advantage = distillation_signal(teacher[token].view(1, 1), logprob.detach(), coef=2.0)
        loss, _ = policy_loss(logprob, logprob.detach(), logprob.detach(), advantage, torch.ones(1, 1),
                              correction="on_policy")
        total = total + logprob.exp().detach() * loss
    total.backward()
    torch.testing.assert_close(logits.grad, expected)
