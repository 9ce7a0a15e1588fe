"""The reward registry: every name a job's YAML can use, and how it finds user rewards.

A reward is `fn(sample, **params) -> float | dict[str, float]`, or, marked `batch`,
`fn(samples, **params) -> list[...]`; either may be `async def`. A float may be a `Verdict`,
which also says why (`Verdict(0.0, "timeout")`): the job counts scores per reason. Rewards are found three ways:
registered in this process (`@rlplatform.reward("name")`, and the built-ins), by import path
(`fn: package.module:function` in YAML), and by name from installed packages that declare the
entry-point group `rlplatform.rewards`. `resolve` binds a job's reward list, checking params.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from rlplatform.config import RewardSpec
from rlplatform.user_code import entry_points_of, import_callable

ENTRY_POINT_GROUP = "rlplatform.rewards"
REQUIRED = inspect.Parameter.empty


class RewardSpecError(ValueError):
    """A job's reward entry that cannot be used: unknown name, bad import path, bad params."""


@dataclass
class RewardFunction:
    name: str
    fn: Callable
    batch: bool  # takes a list of samples, returns a list of scores
    source: str  # built-in | registered | entry point | import path

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)

    def parameters(self) -> Dict[str, Any]:
        """Keyword parameters after the sample argument, with their defaults (REQUIRED if none)."""
        params = list(inspect.signature(self.fn).parameters.values())[1:]
        return {p.name: p.default for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    def describe(self) -> str:
        kind = ("async " if self.is_async else "") + ("batch" if self.batch else "per-sample")
        params = ", ".join(k if v is REQUIRED else f"{k}={v!r}" for k, v in self.parameters().items())
        return f"{self.name:<20} {self.source:<12} {kind:<18} ({params})"


REWARDS: Dict[str, RewardFunction] = {}


def register(name: str, fn: Callable, batch: Optional[bool] = None, source: str = "registered") -> Callable:
    """Make `fn` usable as `name` in job configs; `batch` defaults to `fn.batch` if set."""
    REWARDS[name] = RewardFunction(name, fn, bool(getattr(fn, "batch", False) if batch is None else batch), source)
    return fn


def reward(name: str, batch: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: `@rlplatform.reward("brevity")` registers the function under that name."""
    def decorate(fn: Callable) -> Callable:
        return register(name, fn, batch)
    return decorate


def find(name: str) -> RewardFunction:
    """A reward by name: registered in this process first, then installed entry points."""
    if name in REWARDS:
        return REWARDS[name]
    point = entry_points_of(ENTRY_POINT_GROUP).get(name)
    if point is None:
        known = sorted(set(REWARDS) | set(entry_points_of(ENTRY_POINT_GROUP)))
        raise RewardSpecError(f"unknown reward '{name}'; known: {', '.join(known)}")
    try:
        fn = point.load()
    except Exception as err:  # a plugin's import can fail in any way
        raise RewardSpecError(f"reward '{name}' from entry point {point.value} failed to load: {err}") from None
    return RewardFunction(name, fn, bool(getattr(fn, "batch", False)), "entry point")


def from_import_path(path: str) -> RewardFunction:
    fn = import_callable(path, "reward", RewardSpecError)
    return RewardFunction(path.partition(":")[2], fn, bool(getattr(fn, "batch", False)), "import path")


def all_rewards() -> List[RewardFunction]:
    """Every reward this process can find, for `rlp rewards list`."""
    found = dict(REWARDS)
    for name in entry_points_of(ENTRY_POINT_GROUP):
        if name not in found:
            found[name] = find(name)
    return [found[name] for name in sorted(found)]


@dataclass
class BoundReward:
    """One entry of a job's reward list, resolved to its function."""
    spec: RewardSpec
    function: RewardFunction

    @property
    def label(self) -> str:
        return self.spec.label


def resolve(specs: List[RewardSpec]) -> List[BoundReward]:
    bound = []
    for i, spec in enumerate(specs):
        try:
            function = find(spec.name) if spec.name else from_import_path(spec.fn)
            _check_params(function, spec.params)
        except RewardSpecError as err:
            raise RewardSpecError(f"rewards[{i}]: {err}") from None
        bound.append(BoundReward(spec, function))
    labels = [b.label for b in bound]
    if len(set(labels)) != len(labels):
        raise RewardSpecError(f"rewards: two entries report under the same name: {labels}")
    return bound


def _check_params(function: RewardFunction, params: Dict[str, Any]) -> None:
    accepted = function.parameters()
    takes_any = any(p.kind == p.VAR_KEYWORD for p in inspect.signature(function.fn).parameters.values())
    unknown = [k for k in params if k not in accepted and not takes_any]
    if unknown:
        raise RewardSpecError(f"reward '{function.name}' has no parameter {unknown[0]!r}; "
                              f"it takes: {', '.join(accepted) or 'none'}")
    missing = [k for k, default in accepted.items() if default is REQUIRED and k not in params]
    if missing:
        raise RewardSpecError(f"reward '{function.name}' needs parameter {missing[0]!r} in 'params'")
