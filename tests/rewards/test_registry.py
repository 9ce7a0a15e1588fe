"""The three ways a user's reward is found: the decorator, an import path in YAML, and an
installed package's `rlplatform.rewards` entry point; params are checked against the signature."""

from __future__ import annotations

import textwrap

import pytest

import rlplatform
from rlplatform.config import RewardSpec
from rlplatform.rewards import REWARDS, RewardSpecError, all_rewards, resolve
from rlplatform.rewards.registry import find
from rlplatform.transport.samples import Sample


def sample(completion: str) -> Sample:
    return Sample("g/0", "g", "policy", "1+1=", completion, prompt_ids=[], completion_ids=[], behaviour_logprobs=[],
                  token_versions=[], row={"answer": "2"})


@pytest.fixture
def decorated():
    @rlplatform.reward("test_brevity")
    def brevity(sample, max_len: int = 8) -> float:
        return float(len(sample.completion) <= max_len)

    yield brevity
    REWARDS.pop("test_brevity")


def test_decorator_registers_by_name_with_params(decorated):
    (bound,) = resolve([RewardSpec(name="test_brevity", params={"max_len": 3})])
    assert bound.function.fn is decorated and bound.function.source == "registered"
    assert bound.function.parameters() == {"max_len": 8}
    assert bound.function.fn(sample("12345"), **bound.spec.params) == 0.0
    assert "test_brevity" in [r.name for r in all_rewards()]


def test_unknown_param_and_missing_required_param_are_config_errors(decorated):
    with pytest.raises(RewardSpecError, match="rewards\\[0\\]: reward 'test_brevity' has no parameter 'max_lenn'"):
        resolve([RewardSpec(name="test_brevity", params={"max_lenn": 3})])
    rlplatform.reward("test_needs")(lambda sample, words: 1.0)
    try:
        with pytest.raises(RewardSpecError, match="needs parameter 'words'"):
            resolve([RewardSpec(name="test_needs")])
    finally:
        REWARDS.pop("test_needs")


def test_import_path_route(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(textwrap.dedent("""
        def brevity(sample, max_len=8):
            return {"short": float(len(sample.completion) <= max_len), "length": float(len(sample.completion))}
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    (bound,) = resolve([RewardSpec(fn="my_rewards_mod:brevity", params={"max_len": 2})])
    assert bound.label == "brevity" and bound.function.source == "import path"
    assert bound.function.fn(sample("123"), **bound.spec.params) == {"short": 0.0, "length": 3.0}
    with pytest.raises(RewardSpecError, match="cannot import reward 'my_rewards_mod:nothing'"):
        resolve([RewardSpec(fn="my_rewards_mod:nothing")])


def test_entry_point_route(tmp_path, monkeypatch):
    """An installed distribution declaring group `rlplatform.rewards` is found by name."""
    (tmp_path / "plugin_rewards_pkg.py").write_text("def shout(sample):\n    return float(sample.completion.isupper())\n")
    dist = tmp_path / "plugin_rewards_pkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: plugin-rewards-pkg\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[rlplatform.rewards]\nshout = plugin_rewards_pkg:shout\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = find("shout")
    assert found.source == "entry point" and found.fn(sample("YES")) == 1.0
    assert any(r.name == "shout" and r.source == "entry point" for r in all_rewards())
    (bound,) = resolve([RewardSpec(name="shout")])
    assert bound.function.fn(sample("no")) == 0.0


def test_unknown_name_lists_what_is_known():
    with pytest.raises(RewardSpecError, match="unknown reward 'nope'; known: .*exact_match"):
        resolve([RewardSpec(name="nope")])


def test_two_entries_under_one_name_are_refused():
    with pytest.raises(RewardSpecError, match="same name"):
        resolve([RewardSpec(name="exact_match"), RewardSpec(name="exact_match", weight=2.0)])


