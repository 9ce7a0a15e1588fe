"""The built-in rewards, registered under the names job configs use."""

from rlplatform.rewards.code_sandbox import code_tests
from rlplatform.rewards.math_verifier import math_verify
from rlplatform.rewards.preference import preference_score
from rlplatform.rewards.registry import register
from rlplatform.rewards.safety import blocklist, safety_classifier
from rlplatform.rewards.text_rewards import format_match, length_reward, regex_contains
from rlplatform.rewards.verifiers import exact_match, reported_components, reported_reward

BUILTINS = {
    "exact_match": exact_match,  # completion == row answer
    "math_verify": math_verify,  # final answer symbolically equal to the row answer
    "code_tests": code_tests,  # completion passes the row's tests in a sandbox
    "format_match": format_match,  # the whole completion matches a regex
    "regex_contains": regex_contains,  # the completion contains a regex match
    "length_reward": length_reward,  # 1 up to a target length, falling to 0 at twice it
    "preference_model": preference_score,  # a Hugging Face sequence-classification reward model
    "safety_blocklist": blocklist,  # filter: blocked words or patterns
    "safety_classifier": safety_classifier,  # filter: a Hugging Face classifier flags the text
    "verifiers_reward": reported_reward,  # the score the agent sent in the row (`rlp verifiers` episodes)
    "verifiers_components": reported_components,  # each of its reward functions' scores (list it with weight 0)
}

ROW_FIELDS = {  # the data-row fields a built-in reward reads, given its params: each training row must hold them
    "exact_match": lambda params: [params.get("answer_key", "answer")] if params.get("response") in (
        None, "completion") else [],  # a response field comes from the episode, not the data
    "math_verify": lambda params: ["answer"],
    "code_tests": lambda params: ["tests"],
}

for _name, _fn in BUILTINS.items():
    register(_name, _fn, source="built-in")
