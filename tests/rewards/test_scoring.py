"""The scorer around reward functions: per-sample, batch and async rewards, dict scores,
weights, filters (veto, penalty, drop), and rewards that raise, hang or return garbage."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rlplatform.config import RewardSpec
from rlplatform.rewards import REWARDS, register, resolve
from rlplatform.rewards.scoring import Scorer
from rlplatform.transport.samples import Sample


def samples(*completions: str):
    return [Sample(f"g/{i}", "g", "policy", "1+1=", c, prompt_ids=[], completion_ids=[], behaviour_logprobs=[],
                   token_versions=[], row={"answer": "2"})
            for i, c in enumerate(completions)]


@pytest.fixture
def registered():
    names = []

    def add(name, fn, batch=False):
        names.append(name)
        register(name, fn, batch)

    yield add
    for name in names:
        REWARDS.pop(name, None)


def scorer(*specs: RewardSpec, concurrency: int = 4) -> Scorer:
    return Scorer(resolve(list(specs)), concurrency)


def test_weighted_sum_of_float_and_dict_rewards(registered):
    registered("t_parts", lambda s: {"a": 1.0, "b": 0.5})
    (result,) = scorer(RewardSpec(name="exact_match", weight=2.0), RewardSpec(name="t_parts", weight=0.2)).score(
        samples("2"))
    # 2.0 * 1.0 + 0.2 * (1.0 + 0.5) = 2.3
    assert result.reward == pytest.approx(2.3)
    assert result.components == {"exact_match": 1.0, "t_parts/a": 1.0, "t_parts/b": 0.5}
    assert result.error is None and not result.filtered


def test_batch_and_async_variants(registered):
    calls = []

    def batch_len(items, scale=1.0):
        calls.append(len(items))
        return [scale * len(s.completion) for s in items]

    async def async_judge(sample):
        await asyncio.sleep(0.05)
        return float(sample.completion == "2")

    async def async_batch(items):
        return [1.0 for _ in items]

    registered("t_batch", batch_len, batch=True)
    registered("t_async", async_judge)
    registered("t_async_batch", async_batch, batch=True)
    start = time.perf_counter()
    results = scorer(RewardSpec(name="t_batch", params={"scale": 0.5}), RewardSpec(name="t_async"),
                     RewardSpec(name="t_async_batch"), concurrency=8).score(samples("2", "22", "3", "2"))
    assert calls == [4]  # one call for the whole batch
    assert [r.components["t_batch"] for r in results] == [0.5, 1.0, 0.5, 0.5]
    assert [r.components["t_async"] for r in results] == [1.0, 0.0, 0.0, 1.0]
    assert all(r.components["t_async_batch"] == 1.0 for r in results)
    assert time.perf_counter() - start < 1.0  # the four 50 ms judge calls overlapped


def test_raising_hanging_and_garbage_rewards_become_error_results(registered):
    release = threading.Event()
    registered("t_raises", lambda s: 1 / 0)
    registered("t_hangs", lambda s: release.wait(30) and 1.0)
    registered("t_garbage", lambda s: "high")
    for name, expected in (("t_raises", "ZeroDivisionError"), ("t_garbage", "returned str")):
        (result,) = scorer(RewardSpec(name="exact_match"), RewardSpec(name=name)).score(samples("2"))
        assert expected in result.error and result.error.startswith(name)
        assert result.components == {"exact_match": 1.0}
    hanging = scorer(RewardSpec(name="t_hangs", timeout_s=0.3), concurrency=2)
    start = time.perf_counter()
    first = hanging.score(samples("2", "3"))
    assert time.perf_counter() - start < 2.0
    assert all(r.error == "t_hangs: timeout after 0.3s" for r in first)
    release.set()  # the stuck threads were left behind; new calls get fresh threads and finish
    assert [r.error for r in hanging.score(samples("2"))] == [None]


def test_filters_veto_penalty_and_drop(registered):
    registered("t_flag", lambda s: float("bad" in s.completion))
    def run(on_flag):
        spec = RewardSpec(name="t_flag", role="filter", on_flag=on_flag, penalty=0.3)
        return scorer(RewardSpec(name="exact_match", weight=1.0), spec).score(samples("2", "2 bad"))

    clean, flagged = run("veto")
    assert clean.reward == 1.0 and not clean.filtered
    assert flagged.reward == 0.0 and flagged.filtered and not flagged.drop  # 'bad' != '2' anyway
    _, penalised = run("penalty")
    assert penalised.reward == pytest.approx(-0.3) and penalised.filtered
    _, dropped = run("drop")
    assert dropped.drop and dropped.filtered and dropped.components["t_flag"] == 1.0


def test_veto_zeroes_a_correct_answer(registered):
    registered("t_block_two", lambda s: float(s.completion == "2"))
    spec = RewardSpec(name="t_block_two", role="filter", on_flag="veto")
    (result,) = scorer(RewardSpec(name="exact_match"), spec).score(samples("2"))
    assert result.components["exact_match"] == 1.0 and result.reward == 0.0 and result.filtered


def test_batch_reward_returning_the_wrong_length_is_an_error(registered):
    registered("t_short", lambda items: [1.0], batch=True)
    results = scorer(RewardSpec(name="t_short")).score(samples("a", "b"))
    assert all("expected 2 scores" in r.error for r in results)
