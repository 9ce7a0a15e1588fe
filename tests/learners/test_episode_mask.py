"""Multi-turn samples in a learner step (real DeepSpeed rank): observation tokens (completion_mask 0)
are context only. Whatever they carry (behaviour log-probs, versions) and whichever tokens come after
the last model token, the losses and gradients are those of the model tokens alone; a one-turn
episode (mask all ones) trains exactly like a sample without a mask; `fixed_length` divides by the
episode's token budget."""

from __future__ import annotations

import dataclasses

import pytest

from rlplatform.config import EnvConfig, LearnerConfig, RLConfig, ToolSpec
from rlplatform.learners.group import LearnerGroup
from tests.learners.test_learner import rl_batch
from tests.learners.steps import rl_step
from rlplatform.transport.weight_transports import ObjectStoreTransport

RL = RLConfig(lr_schedule="constant", kl_coef=0.1, entropy_coef=0.01)
COMPARED = ("pg_loss", "entropy", "kl_to_reference", "loss", "grad_norm", "tokens_total", "importance_weight_mean")


def episode(sample, observation, tail):
    """The sample as a two-turn episode: its first two tokens, an observation, the rest, then `tail`
    observation tokens the environment appended after the last model turn."""
    head, rest = sample.completion_ids[:2], sample.completion_ids[2:]
    logprobs, versions = sample.behaviour_logprobs, sample.token_versions
    obs_logprobs, obs_versions = [0.0] * len(observation), [versions[1]] * len(observation)
    return dataclasses.replace(
        sample, completion_ids=head + observation + rest + tail,
        behaviour_logprobs=logprobs[:2] + obs_logprobs + logprobs[2:] + [0.0] * len(tail),
        token_versions=versions[:2] + obs_versions + versions[2:] + [versions[-1]] * len(tail),
        completion_mask=[1, 1] + [0] * len(observation) + [1] * len(rest) + [0] * len(tail))


@pytest.fixture(scope="module")
def learner(ray_session, tiny_policy):
    group = LearnerGroup(LearnerConfig(zero_stage=1), tiny_policy, seed=0,
                         dtype="float32", transport=ObjectStoreTransport())
    group.start_stage(lr=1e-12, keep_reference=True)  # the weights barely move: each step sees the same policy
    yield group
    group.shutdown()


def figures(learner, samples, advantages):
    metrics = rl_step(learner, samples, advantages, RL).metrics()
    return {k: metrics[k] for k in COMPARED}


def test_observation_tokens_carry_no_loss(learner, tiny_policy):
    samples, advantages = rl_batch(tiny_policy)
    samples = [s for s in samples if len(s.completion_ids) >= 3]
    advantages = advantages[:len(samples)]
    clean = [episode(s, [5, 6, 7], [8, 9]) for s in samples]
    # garbage where the mask is 0: other log-probs, versions and trailing tokens
    noisy = []
    for s in clean:
        mask = s.completion_mask
        noisy.append(dataclasses.replace(
            s, behaviour_logprobs=[lp if m else -9.0 for lp, m in zip(s.behaviour_logprobs, mask)],
            token_versions=[v if m else -5 for v, m in zip(s.token_versions, mask)],
            completion_ids=s.completion_ids[:-2] + [20, 21]))
    expected, got = figures(learner, clean, advantages), figures(learner, noisy, advantages)
    assert expected["tokens_total"] == sum(s.trained_tokens for s in clean) == sum(len(s.completion_ids) for s in samples)
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert all(s.version == 0 for s in noisy)  # staleness reads model tokens only


def test_one_turn_episode_trains_like_a_plain_sample(learner, tiny_policy):
    samples, advantages = rl_batch(tiny_policy)
    one_turn = [dataclasses.replace(s, completion_mask=[1] * len(s.completion_ids)) for s in samples]
    assert figures(learner, one_turn, advantages) == pytest.approx(figures(learner, samples, advantages),
                                                                    rel=1e-6, abs=1e-8)


def test_fixed_length_divides_by_the_episode_budget(learner, tiny_policy):
    samples, advantages = rl_batch(tiny_policy)
    # one sign for every sample: with +1 and -1 groups of equal token counts at importance weight 1
    # the policy-gradient loss would be exactly 0
    advantages = [abs(a) for a in advantages]
    rl = dataclasses.replace(RL, loss_aggregation="fixed_length", kl_coef=0.0, entropy_coef=0.0)
    env = EnvConfig(kind="tools", max_turns=3, tools=[ToolSpec(name="calculator")])
    assert env.completion_tokens(rl.max_new_tokens) == 3 * rl.max_new_tokens
    assert dataclasses.replace(env, max_tokens=50).completion_tokens(rl.max_new_tokens) == 50
    assert EnvConfig(max_turns=3).completion_tokens(rl.max_new_tokens) == rl.max_new_tokens  # single turn
    one_turn = rl_step(learner, samples, advantages, rl).figures["pg_loss"]
    episodes = rl_step(learner, samples, advantages, rl,
                       max_tokens=env.completion_tokens(rl.max_new_tokens)).figures["pg_loss"]
    assert one_turn != 0 and episodes == pytest.approx(one_turn / 3, rel=1e-4)
