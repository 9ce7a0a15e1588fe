"""Scoring a batch of samples with a job's rewards: the wrapper around user reward functions.

Runs each reward the way it is written (per sample on a thread pool, as one batch call, or as
coroutines), bounds every call by its `timeout_s`, turns anything a reward raises into an
error result, and combines the scores: rewards add `weight * score`, filters gate the sample
(veto: reward 0, penalty: minus `penalty`, drop: not trained on); a `Verdict`'s reason is kept
by reward label. Never raises for a reward.
"""

from __future__ import annotations

import asyncio
import math
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Dict, List, Union

from rlplatform.rewards.registry import BoundReward
from rlplatform.rewards.verdict import Verdict
from rlplatform.transport.samples import Sample, ScoredSample

Score = Union[float, Dict[str, float]]


@dataclass
class Failure:
    reason: str


class Scorer:
    def __init__(self, rewards: List[BoundReward], concurrency: int = 8) -> None:
        self.rewards = rewards
        self.concurrency = concurrency
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="reward")
        self._loop = None
        if any(r.function.is_async for r in rewards):
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, daemon=True, name="reward-async").start()

    def score(self, samples: List[Sample]) -> List[ScoredSample]:
        results = {r.label: self._run(r, samples) for r in self.rewards}
        return [self._combine(sample, {label: scores[i] for label, scores in results.items()})
                for i, sample in enumerate(samples)]

    def _run(self, bound: BoundReward, samples: List[Sample]) -> List[Union[Score, Failure]]:
        if bound.function.is_async:
            return self._run_async(bound, samples)
        fn, params, timeout = bound.function.fn, bound.spec.params, bound.spec.timeout_s
        if bound.function.batch:
            return self._batch_results(self._pool.submit(fn, samples, **params), timeout, len(samples))
        futures = [self._pool.submit(fn, sample, **params) for sample in samples]
        done, _ = wait(futures, timeout=timeout * math.ceil(len(samples) / self.concurrency))
        if len(done) < len(futures):
            self._replace_pool()
        return [_result(f) if f in done else Failure(f"timeout after {timeout:g}s") for f in futures]

    def _batch_results(self, future, timeout: float, count: int) -> List[Union[Score, Failure]]:
        done, _ = wait([future], timeout=timeout)
        if not done:
            self._replace_pool()
            return [Failure(f"timeout after {timeout:g}s")] * count
        result = _result(future)
        if isinstance(result, Failure):
            return [result] * count
        if not isinstance(result, (list, tuple)) or len(result) != count:
            return [Failure(f"batch reward returned {type(result).__name__} of length "
                            f"{len(result) if hasattr(result, '__len__') else '?'}, expected {count} scores")] * count
        return list(result)

    def _run_async(self, bound: BoundReward, samples: List[Sample]) -> List[Union[Score, Failure]]:
        timeout = bound.spec.timeout_s

        async def one(arg):
            try:
                return await asyncio.wait_for(bound.function.fn(arg, **bound.spec.params), timeout)
            except asyncio.TimeoutError:
                return Failure(f"timeout after {timeout:g}s")
            except Exception as err:  # a user's reward may raise anything
                return Failure(f"{type(err).__name__}: {err}")

        async def everything():
            if bound.function.batch:
                return await one(samples)
            limit = asyncio.Semaphore(self.concurrency)

            async def limited(sample):
                async with limit:
                    return await one(sample)
            return await asyncio.gather(*(limited(s) for s in samples))

        results = asyncio.run_coroutine_threadsafe(everything(), self._loop).result()
        if bound.function.batch:
            if isinstance(results, Failure):
                return [results] * len(samples)
            if not isinstance(results, (list, tuple)) or len(results) != len(samples):
                return [Failure(f"batch reward returned {len(results) if hasattr(results, '__len__') else '?'}"
                                f" scores, expected {len(samples)}")] * len(samples)
        return list(results)

    def _replace_pool(self) -> None:
        """Calls that timed out keep their threads; new work gets fresh ones."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="reward")

    def _combine(self, sample: Sample, scores: Dict[str, Union[Score, Failure]]) -> ScoredSample:
        components: Dict[str, float] = {}
        reasons: Dict[str, str] = {}
        total, vetoed, filtered, drop, errors = 0.0, False, False, False, []
        for bound in self.rewards:
            score = scores[bound.label]
            if isinstance(score, Verdict):
                reasons[bound.label] = score.reason
            try:
                values = _as_components(bound.label, score)
            except (TypeError, ValueError) as err:
                errors.append(f"{bound.label}: {score.reason if isinstance(score, Failure) else err}")
                continue
            components.update(values)
            value = sum(values.values())
            spec = bound.spec
            if spec.role == "reward":
                total += spec.weight * value
                continue
            flagged = max(values.values()) >= 0.5
            filtered |= flagged
            vetoed |= flagged and spec.on_flag == "veto"
            drop |= flagged and spec.on_flag == "drop"
            if spec.on_flag == "penalty":
                total -= spec.penalty * value
        return ScoredSample(sample, 0.0 if vetoed else total, components, "; ".join(errors) or None,
                            filtered=filtered, drop=drop, reasons=reasons)


def _result(future) -> Union[Score, Failure]:
    error = future.exception()
    if error is not None:
        return Failure(f"{type(error).__name__}: {error}")
    return future.result()


def _as_components(label: str, score: Union[Score, Failure]) -> Dict[str, float]:
    """A reward's score as named floats: `label` for a float, `label/key` for a dict."""
    if isinstance(score, Failure):
        raise ValueError(score.reason)
    if isinstance(score, dict):
        if not score:
            raise ValueError("returned an empty dict")
        return {f"{label}/{k}": _finite(v) for k, v in score.items()}
    return {label: _finite(score)}


def _finite(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"returned {type(value).__name__}, expected a float or a dict of floats")
    if not math.isfinite(value):
        raise ValueError(f"returned {value}")
    return float(value)
