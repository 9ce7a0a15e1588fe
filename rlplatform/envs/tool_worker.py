"""The tool worker: reads tool calls from a job's tool queue, runs them, stores each result for the
rollout worker that asked.

Runs as a Ray actor inside a job (`ToolActor`, serving from construction until the job ends, so
for SFT's and the last evaluations too, and again whenever Ray restarts it) or as a standalone
process on any machine that reaches Redis (`rlp tool-worker`), until the job's stop flag is set. Delivery is the reward
worker's loop (`QueueWorker`): at least once, results stored once per call id, calls a dead
worker held reclaimed after `claim_idle_s`, dead letters. Calls run on a thread pool, each bounded
by its tool's `timeout_s`; an unknown tool, a raise or a timeout is an error result whose output
tells the model what went wrong. Counters per tool: calls, errors and latency (submission to result).
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional, Tuple

from rlplatform.actor_classes import LazyActorClass
from rlplatform.config import RewardWorkersConfig, ToolSpec
from rlplatform.envs.tools import resolve_tools
from rlplatform.transport.deadlines import Heartbeats
from rlplatform.transport.queue_worker import QueueStats, QueueWorker
from rlplatform.transport.redis_server import RECONNECT_S, connect
from rlplatform.transport.reward_queue import RewardQueue
from rlplatform.transport.tool_queue import ToolCall, ToolQueue, ToolResult, decode_call, encode_result
from rlplatform.user_code import import_modules

MAX_OUTPUT_CHARS = 2000  # longer tool output is cut to its end, as the model sees it


@dataclass
class ToolStats(QueueStats):
    calls: int = 0
    errors: int = 0


def job_tools_json(tools: List[ToolSpec], imports: List[str]) -> str:
    return json.dumps({"imports": list(imports), "tools": [asdict(t) for t in tools]})


def job_tools_from_json(text: str) -> Tuple[List[ToolSpec], List[str]]:
    body = json.loads(text)
    return [ToolSpec(**t) for t in body["tools"]], body["imports"]


class ToolWorker(QueueWorker):
    def __init__(self, name: str, tools: List[ToolSpec], redis_url: str, run: str,
                 config: Optional[RewardWorkersConfig] = None, *, imports: Optional[List[str]] = None) -> None:
        """`run`: the `run_scope` of the run it serves."""
        config = config or RewardWorkersConfig()
        import_modules(imports or [])
        self.tools = resolve_tools(tools)
        self.timeouts = {spec.label: spec.timeout_s for spec in tools}
        self._pool = ThreadPoolExecutor(config.concurrency, thread_name_prefix="tool")
        client = connect(redis_url, wait_s=RECONNECT_S)  # a restart may meet the job's Redis restarting
        self.tool_queue = ToolQueue(client, run)
        super().__init__(name, self.tool_queue, RewardQueue(client, run), config, ToolStats(),
                         heartbeats=Heartbeats(client, run), label=f"tool worker {name}",
                         round_limit_s=max((spec.timeout_s for spec in tools), default=0.0))

    def decode(self, raw: bytes) -> ToolCall:
        return decode_call(raw)

    def handle(self, calls: List[ToolCall]) -> List[Tuple[str, str, bytes]]:
        futures = {call.call_id: self._pool.submit(self.tools[call.name], call.arguments)
                   for call in calls if call.name in self.tools}
        timeout = max((self.timeouts[call.name] for call in calls if call.name in self.tools), default=0.0)
        finished, _ = wait(futures.values(), timeout=timeout)
        if len(finished) < len(futures):  # calls that timed out keep their threads; new work gets fresh ones
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = ThreadPoolExecutor(self.config.concurrency, thread_name_prefix="tool")
        results = [self._result(call, futures.get(call.call_id), finished) for call in calls]
        self._count(results)
        return [(r.call_id, call.reply_to, encode_result(r)) for r, call in zip(results, calls)]

    def _result(self, call: ToolCall, future, finished) -> ToolResult:
        if future is None:
            output, error = None, f"unknown tool '{call.name}'; tools: {', '.join(self.tools)}"
        elif future not in finished:
            output, error = None, f"timeout after {self.timeouts[call.name]:g}s"
        elif future.exception() is not None:
            output, error = None, f"{type(future.exception()).__name__}: {future.exception()}"
        else:
            output, error = str(future.result()), None
        text = output if error is None else f"error: {error}"
        return ToolResult(call.call_id, call.name, text[-MAX_OUTPUT_CHARS:], error, time.time() - call.created_at)

    def _count(self, results: List[ToolResult]) -> None:
        counters: Dict[str, float] = {}
        for r in results:
            name = r.name if r.name in self.tools else "<unknown>"
            for key, value in ((f"calls/{name}", 1), (f"errors/{name}", r.error is not None),
                               (f"latency_s/{name}", r.latency_s)):
                counters[key] = counters.get(key, 0.0) + float(value)
        self.stats.calls += len(results)
        self.stats.errors += sum(r.error is not None for r in results)
        self.run_queue.add_counters(self.tool_queue.tool_keys.stats, **counters)


def default_tool_worker_name(job: str) -> str:
    return f"{job}-tool-{socket.gethostname()}-{os.getpid()}"


class ToolService(ToolWorker):
    """A tool worker that serves on a thread of its own from the moment it is built until the job kills
    it: past the job's stop flag, which ends RL before the last evaluation's episodes call tools. Each round
    beats, as `QueueWorker.run`'s do, so the job's watchdog restarts a service that hangs."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        threading.Thread(target=self._serve, daemon=True, name="tool-worker").start()

    def _serve(self) -> None:
        while True:
            self.heartbeats.beat(self.label, "serving", round_limit_s=self.round_limit_s)
            self.step()

    def counts(self) -> ToolStats:
        return self.stats


ToolActor = LazyActorClass(ToolService)
