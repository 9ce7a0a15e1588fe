"""DeepSpeed learner ranks (Ray actors, gloo on CPU): one SFT and one RL step move the weights
and lower the loss on the batch they trained on."""

from __future__ import annotations

import numpy as np
import pytest
import ray

from rlplatform.actors.engine import TransformersEngine
from rlplatform.config import LearnerConfig, RLConfig
from rlplatform.learners.group import LearnerGroup
from rlplatform.learners.rank import lr_scale
from rlplatform.transport.samples import Sample
from tests.learners.steps import rl_step
from rlplatform.transport.weight_transports import ObjectStoreTransport

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (13, 7), (40, 45), (9, 9)] * 4]


def snapshot(learner: LearnerGroup) -> dict:
    return ray.get(learner.snapshot_weights())


def max_change(before: dict, after: dict) -> float:
    return max(float(np.abs(before[k] - after[k]).max()) for k in before)


@pytest.fixture(scope="module")
def learner(ray_session, tiny_policy):
    group = LearnerGroup(LearnerConfig(zero_stage=1), tiny_policy, seed=0,
                         dtype="float32", transport=ObjectStoreTransport())
    yield group
    group.shutdown()


def test_sft_step_changes_weights_and_lowers_loss(learner):
    learner.start_stage(lr=1e-2)
    before = snapshot(learner)
    first = learner.sft_step(ROWS)
    assert max_change(before, snapshot(learner)) > 1e-4
    # the second step reports the loss of the updated weights on the same batch
    second = learner.sft_step(ROWS)
    assert second.loss < first.loss


def test_an_sft_step_trains_at_the_fraction_of_the_stage_rate_it_is_given(learner):
    learner.start_stage(lr=1e-2)
    before = snapshot(learner)
    assert learner.sft_step(ROWS, lr_fraction=0.25).metrics()["lr"] == pytest.approx(2.5e-3)
    assert learner.sft_step(ROWS, lr_fraction=0.0).metrics()["lr"] == 0.0
    after_one = snapshot(learner)
    assert max_change(before, after_one) > 1e-4
    learner.sft_step(ROWS, lr_fraction=0.0)  # AdamW at rate 0 leaves the weights as they are
    assert max_change(after_one, snapshot(learner)) == 0.0


def rl_batch(policy_path: str):
    """Sampled completions for two prompts; completions of prompt 0 get +1, prompt 1 gets -1."""
    engine = TransformersEngine(policy_path)
    groups = engine.generate(engine.tokenizer(["1+2=", "40+45="])["input_ids"], 4, 4, 1.0)
    samples, advantages = [], []
    for g, (group, advantage) in enumerate(zip(groups, (1.0, -1.0))):
        for i, c in enumerate(group):
            samples.append(Sample(f"{g}/{i}", str(g), "policy", "", c.text, prompt_ids=c.prompt_ids,
                                  completion_ids=c.completion_ids,
                                  behaviour_logprobs=c.logprobs, token_versions=[0] * len(c.completion_ids)))
            advantages.append(advantage)
    return samples, advantages


def test_rl_step_changes_weights_and_lowers_loss(ray_session, tiny_policy):
    learner = LearnerGroup(LearnerConfig(zero_stage=2), tiny_policy, seed=0,
                           dtype="float32", transport=ObjectStoreTransport())
    try:
        learner.start_stage(lr=1e-2, keep_reference=True)
        samples, advantages = rl_batch(tiny_policy)
        before = snapshot(learner)
        first = rl_step(learner, samples, advantages, RLConfig())
        # fresh samples from these very weights: importance weights are 1, mismatch ~0
        assert first.figures["importance_weight_mean"] == pytest.approx(1.0, abs=1e-4)
        assert first.figures["logprob_mismatch_abs"] < 1e-4
        assert max_change(before, snapshot(learner)) > 1e-4
        second = rl_step(learner, samples, advantages, RLConfig())
        assert second.loss < first.loss
        # the reference is the stage's starting weights: no KL before the update, some after
        assert first.figures["kl_to_reference"] == pytest.approx(0.0, abs=1e-6)
        assert second.figures["kl_to_reference"] > 1e-5
        # without a KL term the reference is scored every reference_kl_every steps only; with one, every step
        every_second = RLConfig(reference_kl_every=2)
        assert "kl_to_reference" not in rl_step(learner, samples, advantages, every_second, step=3).figures
        assert rl_step(learner, samples, advantages, every_second, step=4).figures["kl_to_reference"] > 1e-5
        assert "kl_to_reference" in rl_step(learner, samples, advantages, RLConfig(kl_coef=0.1), step=3).figures
    finally:
        learner.shutdown()


def test_two_ranks_zero3_train_and_publish_full_weights(ray_session, tiny_policy):
    learner = LearnerGroup(LearnerConfig(num_ranks=2, zero_stage=3, num_cpus=0.5), tiny_policy, seed=0,
                           dtype="float32", transport=ObjectStoreTransport())
    try:
        learner.start_stage(lr=1e-2)
        before = snapshot(learner)
        first = learner.sft_step(ROWS)
        after = snapshot(learner)
        assert set(after) == set(before) and all(after[k].shape == before[k].shape for k in before)
        assert max_change(before, after) > 1e-4
        assert learner.sft_step(ROWS).loss < first.loss
    finally:
        learner.shutdown()


def test_ppo_epochs_minibatches_corrections_and_auxiliary_terms(learner, tiny_policy):
    learner.start_stage(lr=1e-2)
    samples, advantages = rl_batch(tiny_policy)
    rl = RLConfig(algorithm="rloo", correction="decoupled_ppo", is_cap=5.0, loss_aggregation="sequence_mean",
                  ppo_epochs=2, minibatches=2, entropy_coef=0.01, sft_coef=0.5)
    before = snapshot(learner)
    first = rl_step(learner, samples, advantages, rl, sft_rows=ROWS)
    assert max_change(before, snapshot(learner)) > 1e-4
    # averaged over 4 updates, 3 of them after the weights left the batch's proximal ones: ratios moved
    assert 0.0 < first.figures["clip_fraction"] < 1.0 and first.figures["importance_weight_mean"] > 0
    second = rl_step(learner, samples, advantages, rl, sft_rows=ROWS)
    assert second.figures["sft_loss"] < first.figures["sft_loss"]  # the SFT term trains on its rows too
    assert {"pg_loss", "entropy", "sft_loss", "loss", "grad_norm", "lr"} <= set(second.metrics())


def test_the_rl_rate_warms_up_then_decays_linearly_to_zero_at_max_steps(learner, tiny_policy):
    learner.start_stage(lr=1e-2)
    samples, advantages = rl_batch(tiny_policy)
    rl = RLConfig(lr_schedule="linear", max_steps=4)
    rates = [rl_step(learner, samples, advantages, rl, step=step).figures["lr"] for step in (0, 1, 3)]
    assert rates == pytest.approx([1e-2, 7.5e-3, 2.5e-3])
    before = snapshot(learner)
    assert rl_step(learner, samples, advantages, rl, step=4).figures["lr"] == 0.0
    assert max_change(before, snapshot(learner)) == 0.0  # the last scheduled step moves nothing
    constant = rl_step(learner, samples, advantages, RLConfig(lr_schedule="constant"), step=3)
    assert constant.figures["lr"] == pytest.approx(1e-2)
    warming = RLConfig(lr_schedule="linear", max_steps=8, warmup_steps=3)  # 1/4, 2/4, 3/4, then the decay alone
    assert [lr_scale(warming, step) for step in range(5)] == pytest.approx([0.25, 0.4375, 0.5625, 0.625, 0.5])
    assert rl_step(learner, samples, advantages, warming, step=0).figures["lr"] == pytest.approx(2.5e-3)
