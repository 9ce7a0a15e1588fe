"""Every built-in reward's results survive a checkpoint: a sample scored by each (as a job scores it, with
its components, reasons, filter flags and errors) is counted into the RL stage's counters, written with
a checkpoint's state and read back equal, so no reward can make a checkpoint fail as `code_tests`' reasons
once did."""

from __future__ import annotations

import pytest

from rlplatform.config import RewardSpec
from rlplatform.job.checkpoint import CheckpointState, PolicyState, read_state, write_checkpoint
from rlplatform.job.rl_loop import RLCounters, _count_scored
from rlplatform.rewards import all_rewards, resolve
from rlplatform.rewards.scoring import Scorer
from rlplatform.transport.samples import ResultMeta

# each built-in reward with what it needs, and the row fields and completion it scores
CASES = {
    "code_tests": ({}, {"tests": ["assert add(1, 2) == 3"]}, "def add(a, b):\n    return a - b\n"),
    "exact_match": ({}, {"answer": "4"}, "4"),
    "format_match": ({}, {}, "<think>2+2</think> <answer>4</answer>"),
    "length_reward": ({"target_len": 3}, {}, "1234"),
    "math_verify": ({}, {"answer": "\\frac{1}{2}"}, "The answer is $0.5$"),
    "preference_model": ("classifier", {}, "a fine reply"),
    "regex_contains": ({"pattern": "4"}, {}, "it is 4"),
    "safety_blocklist": ({"words": ["bad"]}, {}, "a bad word"),
    "safety_classifier": ("classifier", {}, "a reply"),
    "verifiers_reward": ({}, {"verifiers_reward": 0.25}, "played"),
    "verifiers_components": ({}, {"verifiers_rewards": {"correct": 1.0, "short": None}}, "played"),
}


def test_every_built_in_reward_has_a_case():
    assert {r.name for r in all_rewards() if r.source == "built-in"} == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_built_in_rewards_results_round_trip_through_a_checkpoint(name, make_sample, tiny_classifier, tmp_path):
    params, row, completion = CASES[name]
    if params == "classifier":
        params = {"model_path": tiny_classifier(num_labels=2 if name == "safety_classifier" else 1)}
    role = "filter" if name.startswith("safety") else "reward"
    scorer = Scorer(resolve([RewardSpec(name=name, params=params, role=role)]), concurrency=2)
    # the second sample lacks the row's fields: an error result for the rewards that read them
    results = scorer.score([make_sample(completion, prompt="2+2=", **row), make_sample(completion, prompt="x")])
    counters = RLCounters()
    for scored in results:
        _count_scored(ResultMeta.of(scored), counters)
    assert counters.samples_scored == 2
    if name == "code_tests":  # a list of test statements, failed by the completion; the second sample has no tests
        assert counters.reward_reasons == {"code_tests/failed": 1} and counters.reward_errors == 1
    policy = PolicyState(version=3, counters=counters.state(), ledger={}, eval_history=[],
                         rewards={"components": [ResultMeta.of(s).components for s in results]})
    state = CheckpointState(results={}, wandb_run_id=None, attempt=0, policies={"policy": policy})
    path = write_checkpoint(str(tmp_path), 3, state, lambda directory: None, keep_last=2)
    restored = read_state(path).policies["policy"]
    assert RLCounters.from_state(restored.counters) == counters
    assert restored.rewards["components"] == [dict(s.components) for s in results]
