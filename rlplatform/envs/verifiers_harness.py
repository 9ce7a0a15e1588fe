"""The agent program verifiers environments play through a job's OpenAI bridge: a chat turn, in process.

A `verifiers` harness normally launches a program (in a sandbox, a container or a subprocess set up
by `uv`) that talks to verifiers' interception server, which records the rollout's trace and relays
each model call to the provider. This harness is that program as an in-process coroutine: each
launch sends the conversation once and returns after the reply, like verifiers' tool-less chat
program, and verifiers relays the request to the bridge. Every request carries the rollout's trace
id as `X-Episode-Id` (verifiers forwards the program's headers), so all turns of a rollout grow one
token-exact trajectory on the bridge. Multi-turn environments continue a rollout through `resume`,
which relaunches on the whole conversation. Tasks that need tools (MCP toolsets) are refused by
verifiers, since this program runs none.

verifiers imports a harness by its id as a top-level module (or one of its own harnesses), so this
module is also importable as `HARNESS_ID`, the id runs name.
"""

from __future__ import annotations

import sys
from typing import List, Optional

import openai
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.runtimes import ProgramResult, Runtime

from rlplatform.transport.bridge_protocol import EPISODE_HEADER

HARNESS_ID = "rlplatform_bridge_chat"


def _launch_http(endpoint: str) -> openai.DefaultAsyncHttpxClient:
    """An HTTP client of the launch's own, closed when the launch ends. The interception server is on
    loopback (plain HTTP: no CA certificates to load, which cost 21 ms per client); one client shared by
    every launch pooled a connection per rollout in flight, and httpcore scans the whole pool on each
    request (quadratic in the rollouts in flight: over a third of a taskset player's CPU)."""
    return openai.DefaultAsyncHttpxClient(verify=not endpoint.startswith("http://"))


class BridgeChatConfig(vf.HarnessConfig):
    """No settings of its own: sampling is the job's (the bridge applies `rl.temperature`)."""


class BridgeChatHarness(vf.Harness[BridgeChatConfig]):
    """One chat completion per launch, in process, its requests tagged with the rollout's episode id."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: Runtime, endpoint: str, secret: str,
                     mcp_urls: dict, data: vf.TaskData, tool_interception_url: Optional[str] = None) -> ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: List[dict] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt is not None:
            messages.extend(message_to_wire(message) for message in prompt)
        async with _launch_http(endpoint) as http:
            client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, http_client=http,
                                        default_headers={EPISODE_HEADER: trace.id})
            try:
                await client.chat.completions.create(model=ctx.model, messages=messages)
            except openai.APIError as err:
                return ProgramResult(exit_code=1, stdout="", stderr=f"{type(err).__name__}: {err}")
        return ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["BridgeChatHarness"]
sys.modules.setdefault(HARNESS_ID, sys.modules[__name__])
