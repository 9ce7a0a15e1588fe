"""The learner's default micro-batch budget: from the device's free memory and the model's shape, so that
the default config never runs a large minibatch through one forward (a real DeepSpeed rank on CPU); and
the MFU a step reports."""

from __future__ import annotations

import psutil
import pytest
import ray
from transformers import Qwen2Config

from rlplatform.config import LearnerConfig
from rlplatform.learners.budget import (CHECKPOINTING_BELOW_TOKENS, activation_bytes_per_token, micro_batch_tokens,
                                        plan_micro_batches)
from rlplatform.learners.group import LearnerGroup
from rlplatform.policy import load_policy, load_tokenizer
from rlplatform.tokenization import encode_sft
from rlplatform.transport.samples import Sample
from rlplatform.transport.weight_transports import ObjectStoreTransport

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in [(1, 2), (13, 7), (40, 45), (9, 9)]]
QWEN_05B = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151_936)


def test_the_rule_on_qwen2_0_5b_shapes_by_hand():
    # per layer and token in bfloat16: 2 bytes x (8 x 896 + 4 x 4864) = 53,248; 24 layers
    assert activation_bytes_per_token(QWEN_05B, 2, checkpointing=False) == 24 * 53_248
    # checkpointing keeps each layer's input (896 x 2 bytes) and recomputes one layer at a time
    assert activation_bytes_per_token(QWEN_05B, 2, checkpointing=True) == 24 * 1_792 + 53_248
    # an H200 with 139 GiB free, 494M trainable parameters: (149,250,113,536 - 12 x 494M) / 2 / 1,277,952
    # = 56,075 tokens, rounded down to 55,296
    assert micro_batch_tokens(139 * 2 ** 30, 494_000_000, QWEN_05B, 2, checkpointing=False) == 55_296
    assert micro_batch_tokens(0, 494_000_000, QWEN_05B, 2, checkpointing=False) == 1024  # never below 1024


def test_the_minibatch_that_ran_out_of_memory_is_split_within_the_budget():
    # 64 prompts x 8 completions of (40 + 128) tokens in one forward needed more than an H200's 139 GiB
    tokens = 64 * 8 * (40 + 128)
    free = 139 * 2 ** 30
    budget = micro_batch_tokens(free, 494_000_000, QWEN_05B, 2, checkpointing=False)
    assert tokens > 1.5 * budget
    assert budget * activation_bytes_per_token(QWEN_05B, 2, checkpointing=False) <= free / 2


QWEN_7B = Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                      num_key_value_heads=4, vocab_size=152_064)


def test_activation_checkpointing_turns_on_where_memory_holds_too_few_tokens_without_it():
    # 0.5B on an H100's ~70 GiB free: about 27,000 tokens without checkpointing, enough
    tokens, checkpointing = plan_micro_batches(70 * 2 ** 30, 494_000_000, QWEN_05B, 2, None, checkpointing=None)
    assert not checkpointing and tokens == micro_batch_tokens(70 * 2 ** 30, 494_000_000, QWEN_05B, 2, False)
    # a 7B shard with 40 GiB left: 2 x (8 x 3584 + 4 x 18944) x 28 = 5.8 MB per token, about 3,000 tokens without
    # checkpointing; with it each layer keeps its input (28 x 3584 x 2 bytes) plus one layer: about 50,000
    free = 40 * 2 ** 30
    assert micro_batch_tokens(free, 0, QWEN_7B, 2, False) < CHECKPOINTING_BELOW_TOKENS
    tokens, checkpointing = plan_micro_batches(free, 0, QWEN_7B, 2, None, checkpointing=None)
    assert checkpointing and tokens == micro_batch_tokens(free, 0, QWEN_7B, 2, True) > 40_000
    # a hand-set budget memory holds without it needs none; one it does not hold turns it on
    assert plan_micro_batches(free, 0, QWEN_7B, 2, 2048, checkpointing=None) == (2048, False)
    assert plan_micro_batches(free, 0, QWEN_7B, 2, 16384, checkpointing=None) == (16384, True)
    # set by hand either way, it stays
    assert plan_micro_batches(free, 0, QWEN_7B, 2, None, checkpointing=False) == (
        micro_batch_tokens(free, 0, QWEN_7B, 2, False), False)
    assert plan_micro_batches(70 * 2 ** 30, 494_000_000, QWEN_05B, 2, None, checkpointing=True)[1]


def test_a_rank_checkpoints_activations_when_its_budget_outgrows_memory(ray_session, tiny_policy):
    """A micro-batch budget larger than the host's memory holds without checkpointing (unset
    learner.activation_checkpointing): the rank recomputes activations, and trains."""
    learner = LearnerGroup(LearnerConfig(num_cpus=0.5, micro_batch_tokens=10 ** 9), tiny_policy, seed=0,
                           dtype="float32", transport=ObjectStoreTransport())
    try:
        (placement,) = learner.placements()
        assert placement["activation_checkpointing"] and placement["micro_batch_tokens"] == 10 ** 9
        learner.start_stage(lr=1e-2)
        first = learner.sft_step(ROWS)
        assert learner.sft_step(ROWS).loss < first.loss
    finally:
        learner.shutdown()


def long_samples(count: int, tokens: int):
    return [Sample(f"{i}", f"{i}", "policy", "", "", prompt_ids=[5] * 8, completion_ids=[6] * (tokens - 8),
                   behaviour_logprobs=[-1.0] * (tokens - 8),
                   token_versions=[0] * (tokens - 8)) for i in range(count)]


def test_the_default_config_splits_a_large_minibatch(ray_session, tiny_policy):
    config = LearnerConfig(num_cpus=0.5)
    assert config.micro_batch_tokens is None  # the default: from the device
    learner = LearnerGroup(config, tiny_policy, seed=0, dtype="float32", transport=ObjectStoreTransport())
    try:
        (placement,) = learner.placements()
        assert placement["zero_stage"] == 0  # one rank: nothing to partition
        assert not placement["activation_checkpointing"]  # the host's memory holds plenty of tokens without it
        budget = placement["micro_batch_tokens"]
        model_config = load_policy(tiny_policy)[0].config
        params = sum(p.numel() for p in load_policy(tiny_policy)[0].parameters())
        available = psutil.virtual_memory().available
        # the rank's rule on this host: float32 activations, its share of the available memory
        assert micro_batch_tokens(int(available * 0.8), params, model_config, 4, False) <= budget \
            <= micro_batch_tokens(int(available * 1.25), params, model_config, 4, False)
        # a minibatch of 2.5 budgets is cut into 3 micro-batches of at most the budget each
        samples = long_samples(count=5 * budget // 2 // 512, tokens=512)
        minibatches = ray.get(learner.ranks[0]._plan.remote(samples, [1.0] * len(samples), 1, True, 512, step=0))
        sizes = [sum(len(p) + len(c) for p, c in zip(part.prompts, part.completions)) for part in minibatches[0].parts]
        assert len(sizes) == 3 and max(sizes) <= budget and sum(sizes) == len(samples) * 512

        # a step reports its MFU: 6 x parameters x the tokens it trained through the model, per second, over the peak
        learner.start_stage(lr=1e-3)
        step = learner.sft_step(ROWS)
        assert placement["params"] == params and placement["peak_flops"] > 0
        assert step.figures["model_tokens"] == sum(len(p) + len(t) for p, t, _ in (
            encode_sft(load_tokenizer(tiny_policy), row, "auto") for row in ROWS))
        assert step.mfu == pytest.approx(  # the peak the step measured against (`DevicePeak`)
            6 * params * step.figures["model_tokens"] / step.compute_s / step.figures["peak_flops"], rel=1e-6)
        assert step.figures["peak_flops"] >= placement["peak_flops"]
    finally:
        learner.shutdown()
