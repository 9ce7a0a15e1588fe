"""Tools and an environment the episode tests name by import path (as a job's YAML would)."""

from __future__ import annotations

import itertools
import threading
import time

from rlplatform.envs.environment import Reply, ToolEnvironment
from rlplatform.envs.tool_calls import ParsedCall

gate = threading.Event()  # `wait_for_gate` returns once a test sets it


def slow_echo(arguments, *, delay_s: float = 0.0) -> str:
    time.sleep(delay_s)
    return f"echo {arguments}"


def wait_for_gate(arguments) -> str:
    gate.wait(60)
    return "open"


class CallOnce(ToolEnvironment):
    """After the first model turn, whatever the model wrote, calls the row's `tool` on the row's
    `arguments` (rows without a `tool` end there); the next model turn ends the episode."""

    def start(self, row):
        self.row, self.called = row, False
        return super().start(row)

    def step(self, turn: str) -> Reply:
        if "tool" in self.row and not self.called:
            self.called = True
            return Reply(tool_calls=[ParsedCall(self.row["tool"], self.row["arguments"])])
        return Reply(done=True, fields={"final_response": turn})


class CalculateThePrompt(ToolEnvironment):
    """After the first model turn, whatever the model wrote, computes the row's prompt ("123*4=")
    with the calculator; the next model turn ends the episode (a job test's tool traffic)."""

    def start(self, row):
        self.expression, self.called = row["prompt"].rstrip("="), False
        return super().start(row)

    def step(self, turn: str) -> Reply:
        if not self.called:
            self.called = True
            return Reply(tool_calls=[ParsedCall("calculator", self.expression)])
        return Reply(done=True, fields={"final_response": turn.strip()})


class SlowToolOrTalk(ToolEnvironment):
    """Every other episode calls `slow_echo` after its first model turn and ends at its next; the others
    are answered by a user turn ("go on") until `env.max_turns` ends them: they decode while the
    callers wait."""
    made = itertools.count()

    def start(self, row):
        self.calls, self.called = next(self.made) % 2 == 0, False
        return super().start(row)

    def step(self, turn: str) -> Reply:
        if not self.calls:
            return Reply(observation=[{"role": "user", "content": " go on"}])
        if self.called:
            return Reply(done=True, fields={"final_response": turn})
        self.called = True
        return Reply(tool_calls=[ParsedCall("slow_echo", "x")])


class Scripted(ToolEnvironment):
    """The job's tool environment reading the row's `turns` in place of what the model wrote, turn by turn."""

    def start(self, row):
        self.turns = iter(row["turns"])
        return super().start(row)

    def step(self, turn: str) -> Reply:
        return super().step(next(self.turns))


class TalkTwice(ToolEnvironment):
    """Answers the first model turn with a user turn (" go on") and ends at the second: two turns, no tools."""

    def start(self, row):
        self.answered = False
        return super().start(row)

    def step(self, turn: str) -> Reply:
        if self.answered:
            return Reply(done=True, fields={"final_response": turn})
        self.answered = True
        return Reply(observation=[{"role": "user", "content": " go on"}])
