"""Held-out evaluation by the job's rewards: pass@1 and the unbiased pass@k, reward and component
means, and a code dataset (prompt + tests, no answer) evaluated end to end by a rollout worker."""

from __future__ import annotations

import math

import pytest

from rlplatform.config import EvalConfig, RewardSpec, RLConfig, RolloutConfig
from rlplatform.monitoring.eval_figures import evaluation_figures, pass_at_k
from rlplatform.rewards.registry import resolve
from rlplatform.rewards.scoring import Scorer
from rlplatform.transport.samples import Sample

TESTS = "assert add(2, 3) == 5\n"
RIGHT, WRONG = "def add(a, b):\n    return a + b", "def add(a, b):\n    return a - b"


def sample(group: int, index: int, completion: str) -> Sample:
    return Sample(f"eval/{group}/{index}", f"eval/{group}", "policy", "write add", completion, prompt_ids=[1],
                  completion_ids=[1], behaviour_logprobs=[0.0], token_versions=[0],
                  row={"prompt": "write add", "tests": TESTS})


def test_pass_at_k_is_the_unbiased_estimator():
    # n = 4 completions, c = 1 correct: pass@1 = 1/4; pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0  # fewer than k wrong: some pick passes


def test_code_completions_scored_by_the_job_rewards():
    specs = [RewardSpec(name="code_tests"), RewardSpec(name="length_reward", weight=0.5, params={"target_len": 1000})]
    scorer = Scorer(resolve(specs))
    # prompt 0: 1 of 4 completions passes its tests; prompt 1: 3 of 4
    completions = [[RIGHT, WRONG, WRONG, WRONG], [RIGHT, RIGHT, RIGHT, WRONG]]
    scored = scorer.score([sample(g, i, c) for g, group in enumerate(completions) for i, c in enumerate(group)])
    figures = evaluation_figures(scored, 4, scorer.rewards)
    assert figures["components"]["code_tests"] == pytest.approx(4 / 8)
    assert figures["components"]["length_reward"] == pytest.approx(1.0)
    assert figures["reward_mean"] == pytest.approx(4 / 8 + 0.5)
    # a completion passes when every role=reward entry scores 1: here code_tests decides
    assert figures["pass_at_1"] == figures["accuracy"] == pytest.approx((1 / 4 + 3 / 4) / 2)
    assert figures["pass_at_4"] == pytest.approx((1.0 + 1.0) / 2)
    assert figures["rows"] == 2 and figures["completions"] == 8 and figures["reward_errors"] == 0
    # a pass_reward names the one entry that decides: length_reward passes every completion
    assert evaluation_figures(scored, 4, scorer.rewards, pass_reward="length_reward")["pass_at_1"] == 1.0


def test_rollout_worker_evaluates_a_code_dataset_without_an_answer_field(redis_server, tiny_policy, tmp_path):
    from rlplatform.actors.rollout import RolloutWorker
    from rlplatform.actors.rollout_spec import RolloutSpec
    from rlplatform.policy import load_tokenizer
    from rlplatform.tokenization import encode_prompts, save_prompts
    from rlplatform.transport.weight_transports import ObjectStoreTransport

    rows = [{"prompt": "1+1=", "tests": "assert True"}, {"prompt": "2+2=", "tests": "assert False"}]
    prompts = encode_prompts(load_tokenizer(tiny_policy), rows, "auto")
    prompts_path = save_prompts(prompts, str(tmp_path / "prompts.jsonl"))
    worker = RolloutWorker(RolloutSpec(0, "policy", "eval-test", tiny_policy, prompts_path, redis_url=redis_server,
                                       rl=RLConfig(),
                                       rollout=RolloutConfig(), dtype="float32", transport=ObjectStoreTransport()))
    config = EvalConfig(greedy=False, samples_per_prompt=3, max_new_tokens=3, batch_size=1)
    figures = worker.evaluate(prompts, config, [RewardSpec(name="code_tests")], [])
    assert figures["rows"] == 2 and figures["completions"] == 6 and figures["reward_errors"] == 0
    # random 3-token code either runs ("assert True" then passes) or not; "assert False" never passes
    assert set(figures) >= {"accuracy", "pass_at_1", "pass_at_3", "reward_mean", "components"}
    assert figures["pass_at_1"] <= 0.5 and math.isclose(figures["reward_mean"], figures["components"]["code_tests"])
