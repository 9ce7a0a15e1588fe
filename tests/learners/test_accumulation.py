"""How an RL step is cut up must not change the update: the same batch trained by one rank at once and
by two ranks with uneven shares (5 samples) in micro-batches under ZeRO-0, 2 and 3 gives the same
weights, gradient norm and metrics (real DeepSpeed, gloo); so does an SFT step before it on 5 rows split
3 and 2 (the loss is a mean over every rank's tokens). Under ZeRO-3 the KL reference is sharded like the
policy and gives the same KL."""

from __future__ import annotations

import numpy as np
import pytest
import ray

from rlplatform.config import LearnerConfig, RLConfig
from rlplatform.token_budget import micro_batches
from rlplatform.learners.group import LearnerGroup, shard_minibatches
from tests.learners.test_learner import ROWS, rl_batch
from tests.learners.steps import rl_step
from rlplatform.transport.weight_transports import ObjectStoreTransport

# 2 minibatches per step: the second optimizer step's AdamW update depends on the gradients' scale
RL = RLConfig(minibatches=2, entropy_coef=0.01, kl_coef=0.1, sft_coef=0.5)
SETTINGS = {  # name: (ranks, zero stage, micro_batch_tokens)
    "one_rank_whole": (1, 1, 10 ** 6),
    "two_ranks_zero0_micro": (2, 0, 12),
    "two_ranks_zero2_micro": (2, 2, 12),
    "two_ranks_zero3_micro": (2, 3, 12),
}


def test_minibatch_blocks_are_dealt_so_each_rank_holds_its_part_of_every_minibatch():
    items = list(range(10))
    shares = shard_minibatches(items, ranks=2, minibatches=3)
    assert shares == [[0, 1, 2, 6, 7, 8], [3, 4, 5, 9]]
    for j in range(3):  # rank r's items j::3 together are the batch's minibatch j, items[j::3]
        assert sorted(shares[0][j::3] + shares[1][j::3]) == items[j::3]
    assert shard_minibatches([0, 1, 2], ranks=2, minibatches=8) == [[0, 1, 2], []]


def test_micro_batches_hold_at_most_the_token_budget():
    assert micro_batches([5, 4, 3, 9, 1], 9) == [[0, 1], [2], [3], [4]]
    assert micro_batches([5, 4, 3], 0) == [[0, 1, 2]]
    assert micro_batches([12, 3], 10) == [[0], [1]]  # a longer sample gets a micro-batch of its own


@pytest.fixture(scope="module")
def batch(tiny_policy):
    samples, advantages = rl_batch(tiny_policy)
    return samples[:5], advantages[:5]  # 5 samples: 2 ranks hold 3 and 2, some micro-batches are stand-ins


def trained(tiny_policy, batch, ranks, zero_stage, micro_batch_tokens, checkpoint_dir):
    config = LearnerConfig(num_ranks=ranks, zero_stage=zero_stage, micro_batch_tokens=micro_batch_tokens,
                           num_cpus=0.5)
    learner = LearnerGroup(config, tiny_policy, seed=0, dtype="float32", transport=ObjectStoreTransport())
    try:
        learner.start_stage(lr=1e-3, keep_reference=True)
        reference_held = [p["reference_elements"] for p in learner.placements()]
        sft = learner.sft_step(ROWS[:5])  # 2 ranks: 3 and 2 rows of different lengths
        step = rl_step(learner, *batch, RL, sft_rows=ROWS[:3])
        weights = ray.get(learner.snapshot_weights())
        learner.save(checkpoint_dir)  # the reference is saved gathered and loaded back into its shards
        learner.load_checkpoint(checkpoint_dir)
        assert all(np.array_equal(v, weights[k]) for k, v in ray.get(learner.snapshot_weights()).items())
        metrics = {**step.metrics(), "sft_step_loss": sft.loss, "sft_step_grad_norm": sft.figures["grad_norm"]}
        return metrics, weights, reference_held
    finally:
        learner.shutdown()


def test_micro_batches_and_uneven_ranks_give_the_single_pass_update(ray_session, tiny_policy, batch, tmp_path):
    results = {name: trained(tiny_policy, batch, *setting, str(tmp_path / name)) for name, setting in SETTINGS.items()}
    expected_metrics, expected_weights, (whole_reference,) = results.pop("one_rank_whole")
    assert expected_metrics["tokens_total"] == sum(len(s.completion_ids) for s in batch[0])
    for name, (metrics, weights, reference_held) in results.items():
        if "zero3" in name:  # the frozen reference is sharded across the ranks, as the policy is
            assert all(held < whole_reference for held in reference_held) and sum(reference_held) >= whole_reference
        else:
            assert reference_held == [whole_reference] * len(reference_held), name
        # float32 sums in another order: AdamW's steps of 1e-3 differ by ~2e-6 where a gradient is ~0
        worst = max(float(np.abs(weights[k] - expected_weights[k]).max()) for k in expected_weights)
        assert worst < 1e-5, name
        for key in ("grad_norm", "pg_loss", "entropy", "kl_to_reference", "sft_loss", "loss", "clip_fraction",
                    "importance_weight_mean", "importance_weight_max", "tokens_total", "sft_step_loss",
                    "sft_step_grad_norm"):
            assert metrics[key] == pytest.approx(expected_metrics[key], rel=1e-4, abs=1e-6), (name, key)
