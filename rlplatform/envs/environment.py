"""The environment contract: what turns a data row into an episode of one or more model turns.

An environment is made per episode from the job's `env` config. `start` gives the first prompt
(a conversation: a list of {role, content}); `step` answers each model turn with a `Reply`:
observations to show the model next (tool or user turns), tool calls to run first (their results
come back through `tool_results`, which answers with a `Reply` in turn), or the end of the episode
with per-episode fields that the rewards read from the sample's row. The rollout side
(`actors/episodes.py`) keeps the token sequence and enforces `env.max_turns` and `env.max_tokens`.
Environments are named in `ENVIRONMENTS`, or given by import path (`env.fn`).
"""

from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Callable, Dict, List, Protocol

from rlplatform.config import EnvConfig
from rlplatform.envs.tool_calls import ParsedCall, parse_tool_calls
from rlplatform.user_code import import_callable
from rlplatform.tokenization import prompt_messages
from rlplatform.transport.tool_queue import ToolResult

Message = Dict[str, str]


@dataclass
class Reply:
    """The environment's answer to a model turn (or to the results of the tool calls it asked for)."""
    observation: List[Message] = field(default_factory=list)  # shown to the model next (role tool or user)
    tool_calls: List[ParsedCall] = field(default_factory=list)  # to run on tool workers before anything is shown
    done: bool = False  # the episode ends here
    fields: Dict[str, Any] = field(default_factory=dict)  # with done: added to the sample's row for the rewards
    malformed_calls: int = 0  # tool calls of the turn written wrong (the observation says why)
    _: KW_ONLY
    unknown_tool_calls: int = 0  # tool calls of the turn naming no tool of the job


class Environment(Protocol):
    def start(self, row: Dict[str, Any]) -> List[Message]: ...

    def step(self, turn: str) -> Reply: ...

    def tool_results(self, results: List[ToolResult]) -> Reply: ...


class SingleTurnEnvironment:
    """One completion per prompt, as without an environment: the default."""

    def __init__(self, config: EnvConfig) -> None:
        pass

    def start(self, row: Dict[str, Any]) -> List[Message]:
        return prompt_messages(row)

    def step(self, turn: str) -> Reply:
        return Reply(done=True)

    def tool_results(self, results: List[ToolResult]) -> Reply:
        raise RuntimeError("a single-turn episode calls no tools")


class ToolEnvironment:
    """The model may call the job's tools (`<tool>name(args)</tool>` or JSON tool calls) and sees
    each result as a tool turn; the first turn without a call ends the episode, its text the
    episode's `final_response`. A malformed call or an unknown tool is shown as an error observation."""

    def __init__(self, config: EnvConfig) -> None:
        self.tools = [spec.label for spec in config.tools]

    def start(self, row: Dict[str, Any]) -> List[Message]:
        return prompt_messages(row)

    def step(self, turn: str) -> Reply:
        parsed = parse_tool_calls(turn)
        if parsed.error:
            return Reply(observation=[_error(parsed.error)], malformed_calls=1)
        unknown = [call.name for call in parsed.calls if call.name not in self.tools]
        if unknown:
            return Reply(observation=[_error(f"unknown tool '{unknown[0]}'; tools: {', '.join(self.tools)}")],
                         unknown_tool_calls=len(unknown))
        if parsed.calls:
            return Reply(tool_calls=parsed.calls)
        return Reply(done=True, fields={"final_response": turn.strip()})

    def tool_results(self, results: List[ToolResult]) -> Reply:
        return Reply(observation=[{"role": "tool", "content": r.output} for r in results])


def _error(text: str) -> Message:
    return {"role": "tool", "content": f"error: {text}"}


ENVIRONMENTS: Dict[str, Callable[[EnvConfig], Environment]] = {
    "single_turn": SingleTurnEnvironment,
    "tools": ToolEnvironment,
}


def environment_factory(config: EnvConfig) -> Callable[[], Environment]:
    """Makes one environment per episode: `env.fn`'s class, else the one `env.kind` names."""
    cls = import_callable(config.fn, "environment", ValueError) if config.fn else ENVIRONMENTS[config.kind]
    return lambda: cls(config)
