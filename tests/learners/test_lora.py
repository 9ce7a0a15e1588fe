"""LoRA learners (real DeepSpeed ranks as Ray actors, gloo on CPU): SFT and RL steps move the
adapters and nothing else, the KL reference is the base model without a copy of it, the published
snapshot holds the adapters alone, and a checkpoint holds only adapters and their optimizer state
and round-trips them exactly under ZeRO-1 and ZeRO-3."""

from __future__ import annotations

import os

import numpy as np
import pytest
import ray
import torch

from rlplatform.config import LearnerConfig, LoraConfig, RLConfig
from rlplatform.learners.group import LearnerGroup
from rlplatform.policy import load_policy
from rlplatform.transport.adapters import AdapterSnapshot
from rlplatform.transport.weight_transports import ObjectStoreTransport
from rlplatform.transport.weights import to_snapshot
from tests.learners.test_learner import ROWS, rl_batch
from tests.learners.steps import rl_step

LORA = LoraConfig(enabled=True, rank=1, alpha=2.0)


def module_state(learner: LearnerGroup) -> dict:
    """Rank 0's whole model, base weights and adapters, by state-dict name (ZeRO-1: held whole)."""
    return ray.get(learner.ranks[0].__ray_call__.remote(
        lambda rank: {k: v.detach().clone().numpy() for k, v in rank.engine.module.state_dict().items()}))


def full_model_bytes(policy_path: str) -> int:
    model, _ = load_policy(policy_path)
    return sum(array.nbytes for array in to_snapshot(model.state_dict()).values())


@pytest.fixture(scope="module")
def lora_learner(ray_session, tiny_policy):
    group = LearnerGroup(LearnerConfig(zero_stage=1), tiny_policy, seed=0, lora=LORA,
                         dtype="float32", transport=ObjectStoreTransport())
    yield group
    group.shutdown()


def test_sft_and_rl_steps_train_the_adapters_alone_against_the_base(lora_learner, tiny_policy):
    lora_learner.start_stage(lr=1e-2)
    before = module_state(lora_learner)
    first, second = lora_learner.sft_step(ROWS), lora_learner.sft_step(ROWS)
    assert second.loss < first.loss
    lora_learner.start_stage(lr=1e-2, keep_reference=True)
    samples, advantages = rl_batch(tiny_policy)
    rl_first = rl_step(lora_learner, samples, advantages, RLConfig())
    rl_second = rl_step(lora_learner, samples, advantages, RLConfig())
    after = module_state(lora_learner)
    adapters = [k for k in before if ".lora_" in k]
    assert adapters and all(".lora_" in k for k in after if k not in before or k in adapters)
    assert all(np.array_equal(before[k], after[k]) for k in before if k not in adapters)  # the base is frozen
    assert all(not np.array_equal(before[k], after[k]) for k in adapters if ".lora_B." in k)
    # the reference is the base: adapters trained by SFT already put the RL start away from it
    assert rl_first.figures["kl_to_reference"] > 1e-6 and rl_second.figures["kl_to_reference"] > 1e-6
    assert lora_learner.placements()[0]["reference_elements"] == 0  # and it holds no weights of its own


def test_snapshot_holds_the_adapters_under_peft_names(lora_learner, tiny_policy):
    snapshot = ray.get(lora_learner.snapshot_weights())
    assert isinstance(snapshot, AdapterSnapshot)
    assert snapshot.config["r"] == 1 and snapshot.config["lora_alpha"] == 2.0
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in snapshot)
    assert sum(array.nbytes for array in snapshot.values()) < 0.05 * full_model_bytes(tiny_policy)


def adapters(learner: LearnerGroup) -> dict:
    return dict(ray.get(learner.snapshot_weights()))


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_checkpoint_holds_adapters_and_their_optimizer_state_and_round_trips(ray_session, tiny_policy, tmp_path,
                                                                             zero_stage):
    learner = LearnerGroup(LearnerConfig(zero_stage=zero_stage), tiny_policy, seed=0, lora=LORA,
                           dtype="float32", transport=ObjectStoreTransport())
    try:
        learner.start_stage(lr=1e-2)
        learner.sft_step(ROWS)
        learner.save(str(tmp_path))
        saved = adapters(learner)
        learner.sft_step(ROWS)
        continued = adapters(learner)
        learner.load_checkpoint(str(tmp_path))
        assert all(np.array_equal(v, saved[k]) for k, v in adapters(learner).items())
        learner.sft_step(ROWS)  # the same step again: equal only if Adam's moments came back too
        assert all(np.array_equal(v, continued[k]) for k, v in adapters(learner).items())
    finally:
        learner.shutdown()
    files = [os.path.join(folder, name) for folder, _, names in os.walk(tmp_path) for name in names
             if name.endswith("states.pt")]
    # a full fine-tuning checkpoint holds the model and twice its size in Adam moments
    assert sum(os.path.getsize(f) for f in files) < 0.5 * full_model_bytes(tiny_policy)
    if zero_stage == 1:
        (model_states,) = [f for f in files if f.endswith("model_states.pt")]
        module = torch.load(model_states, weights_only=False)["module"]
        # DeepSpeed drops frozen parameters by name: an output head tied to the embedding is kept under its own
        assert module and all(".lora_" in name or name == "base_model.model.lm_head.weight" for name in module)
