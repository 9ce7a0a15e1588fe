"""Tools and an environment the episode tests name by import path (as a job's YAML would)."""

from __future__ import annotations

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
