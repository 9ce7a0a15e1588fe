"""Environments of the `verifiers` library as a job's episodes, played through its OpenAI bridge.

Data flow: each task of a verifiers taskset -> `group_size` rollouts, run by verifiers' own env
machinery (its interception server records each rollout's trace; the task's stop conditions and
rewards run as in a verifiers eval) with `BridgeChatHarness`, whose model requests reach a rollout
worker's bridge tagged with the rollout's trace id as episode id, so each rollout is one token-exact
trajectory there -> when a rollout ends, its bridge episode is finished as sample `<group>/<trace id>`
with a row of the task's fields plus `verifiers_reward` (the trace's reward) and `verifiers_rewards`
(each reward function's score) -> the job's reward queue, where the built-in reward
`verifiers_reward` returns that value.

Every model seat of an environment plays through the bridge (a simulated user too). A trace the
environment marks untrainable, every trace of a failed rollout and those of attempts verifiers
retried are discarded on the bridge (`DELETE /v1/episodes/<id>`) and counted: nothing is left
half-recorded in a worker's memory. A task whose group is left short of `group_size` samples expires
on the learner's side at the job's group deadline (`GroupDeadline`) and is counted in `groups_expired`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import uuid
from dataclasses import KW_ONLY, dataclass, field
from typing import Dict, Iterator, List, Optional, Sequence

import httpx

from rlplatform.config import BRIDGE_KEY_ENV
from rlplatform.transport.bridge_protocol import DISCARD_ROUTE, FINISH_ROUTE

INSTALL_HINT = "the verifiers extra is not installed: pip install 'rlplatform[verifiers]'"
FULL_RETRY_S = 0.5  # a finish the job refused for now (its groups in play are at the staleness bound) is sent again


@dataclass
class PlayStats:
    """What a run of `play` sent to the job."""
    groups: int = 0  # tasks played (group_size rollouts each)
    finished: int = 0  # episodes finished on the bridge: samples in the reward queue
    failed: int = 0  # rollouts that failed; their episodes were discarded
    discarded: int = 0  # bridge episodes discarded (failed, untrainable or retried)
    reward_sum: float = 0.0  # of the finished episodes' verifiers rewards
    _: KW_ONLY
    errors: List[str] = field(default_factory=list)  # the first few failures, for the user

    @property
    def mean_reward(self) -> float:
        return self.reward_sum / self.finished if self.finished else 0.0


class BridgeClient:
    """The bridge's episode endpoints on one rollout worker (`url` ends in `/v1`)."""

    def __init__(self, url: str, http: httpx.AsyncClient) -> None:
        self.url = url.rstrip("/")
        self.http = http

    async def model(self) -> str:
        """The policy this worker serves."""
        try:
            reply = await self.http.get(f"{self.url}/models")
            reply.raise_for_status()
            return reply.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError) as err:
            raise ConnectionError(f"no OpenAI bridge answers at {self.url} ({type(err).__name__}: {err}); start "
                                  "the job with rollout.openai_bridge.enabled and use a URL it printed") from None

    async def finish(self, episode_id: str, group: str, row: Dict) -> None:
        """Send the episode to the job; while the job holds as many groups in play as its staleness rule
        allows (429), wait and send it again."""
        while True:
            reply = await self.http.post(self.url + FINISH_ROUTE.format(episode_id=episode_id),
                                         json={"group": group, "row": row})
            if reply.status_code != 429:
                reply.raise_for_status()
                return
            await asyncio.sleep(FULL_RETRY_S)

    async def discard(self, episode_id: str) -> bool:
        """Drop the episode if the worker holds it (a rollout that failed before its first reply never started one)."""
        try:
            reply = await self.http.delete(self.url + DISCARD_ROUTE.format(episode_id=episode_id))
        except httpx.TransportError as err:  # every failed rollout comes here: a bridge gone ends the run
            raise ConnectionError(f"the OpenAI bridge at {self.url} stopped answering ({type(err).__name__}): the "
                                  "job has ended, or its rollout worker is restarting") from None
        if reply.status_code == 404:
            return False
        reply.raise_for_status()
        return True


def bridge_http() -> httpx.AsyncClient:
    """An HTTP client for the bridges' episode routes, sending the bridges' key where this process holds one."""
    key = os.environ.get(BRIDGE_KEY_ENV)
    return httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0),
                             headers={"Authorization": f"Bearer {key}"} if key else None)


def load_env(taskset_id: str, taskset_args: Optional[Dict] = None):
    """The verifiers environment of taskset `taskset_id` (a top-level module, importable or in the working
    directory, or a `.py` file's path, exporting a `Taskset` and optionally an `Env`) with the taskset config
    fields `taskset_args`, every agent seat played by `BridgeChatHarness` in this process."""
    try:
        from verifiers.v1 import AgentConfig, EnvConfig
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    from verifiers.v1.utils.generic import concrete_type
    from verifiers.v1.utils.loaders import environment_class

    from rlplatform.envs.verifiers_harness import HARNESS_ID
    from rlplatform.user_code import importable_from_cwd

    importable_from_cwd()
    if taskset_id.endswith(".py"):  # a file: its folder on the path, its name the module's
        folder, file = os.path.split(os.path.abspath(taskset_id))
        if folder not in sys.path:
            sys.path.insert(0, folder)
        taskset_id = file[:-len(".py")]
    env_class = environment_class(taskset_id)
    config_class = concrete_type(env_class, EnvConfig) or EnvConfig
    seats = [name for name, spec in config_class.model_fields.items() if isinstance(spec.default, AgentConfig)]
    seat = {"harness": {"id": HARNESS_ID}, "runtime": {"type": "subprocess"}}
    taskset = {**(taskset_args or {}), "id": taskset_id}
    return env_class(config_class.model_validate({"taskset": taskset, **{name: seat for name in seats}}))


def sample_row(task, trace) -> Dict:
    """The finished episode's row: the task's fields, its verifiers reward and each reward function's score."""
    row = task.data.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
    row["task"] = task.key
    row["verifiers_reward"] = trace.reward
    row["verifiers_rewards"] = {name: (r.score if r is not None else None) for name, r in trace.rewards.items()}
    return row


class Player:
    """Plays tasks of one environment: `group_size` rollouts per task, spread over the bridge URLs."""

    def __init__(self, env, bridges: Sequence[BridgeClient], models: Sequence[str], group_size: int,
                 concurrency: int) -> None:
        from verifiers.v1 import EvalClientConfig, ModelContext

        self.env = env
        self.group_size = group_size
        self.run = uuid.uuid4().hex[:8]
        self.stats = PlayStats()
        self.episodes = asyncio.Semaphore(concurrency)
        contexts = [ModelContext(model=model, client=EvalClientConfig(base_url=b.url, api_key_var=BRIDGE_KEY_ENV))
                    for b, model in zip(bridges, models)]
        self.seats = itertools.cycle(list(zip(bridges, contexts)))
        self.lost: Optional[ConnectionError] = None  # a bridge stopped answering: no rollout starts after it

    async def play_task(self, group: str, task) -> None:
        """`group_size` rollouts of `task`, finished into group `group`."""
        rollouts = [self._rollout(task, group, *next(self.seats)) for _ in range(self.group_size)]
        await asyncio.gather(*rollouts)
        self.stats.groups += 1

    async def _rollout(self, task, group: str, bridge: BridgeClient, ctx) -> None:
        """One rollout; its episodes discarded unless finished. A lost bridge is kept in `lost`, not raised."""
        minted: List[str] = []
        slot = self.env.slots(task, 1)[0]
        try:
            await self._play(task, group, bridge, ctx, slot, minted=minted)
            for episode_id in minted:
                if await bridge.discard(episode_id):
                    self.stats.discarded += 1
        except ConnectionError as err:
            self.lost = self.lost or err

    async def _play(self, task, group: str, bridge: BridgeClient, ctx, slot, *, minted: List[str]) -> None:
        """Run the rollout and finish its trainable trace's episode; `minted` is left holding those to discard."""
        async with self.episodes:
            if self.lost is not None:
                return
            episode = await self.env.run_slot(slot, ctx, on_trace=lambda trace: minted.append(trace.id))
        try:
            trainable = [t for t in episode.traces if t.agent.trainable]
            if not episode.ok or len(trainable) != 1:
                raise RuntimeError(_failure(episode, len(trainable)))
            trace = trainable[0]
            await bridge.finish(trace.id, group, sample_row(task, trace))
            self.stats.finished += 1
            self.stats.reward_sum += trace.reward
            minted.remove(trace.id)
        except Exception as err:  # the rollout is lost, not the run: reported, its episodes discarded
            self.stats.failed += 1
            if len(self.stats.errors) < 5:
                self.stats.errors.append(f"task {task.key} ({group}): {type(err).__name__}: {err}")


def _failure(episode, trainable: int) -> str:
    if not episode.ok:
        errors = list(episode.errors) + [e for trace in episode.traces for e in trace.errors]
        return "; ".join(f"{e.type}: {e.message}" for e in errors) or "the rollout did not complete"
    return f"the episode has {trainable} trainable traces; a sample is one trainable trace"


def _tasks(taskset, num_tasks: Optional[int], epochs: int) -> Iterator:
    if num_tasks is None and not taskset.bounded:
        raise ValueError("this taskset is infinite: give the number of tasks to play (--num-tasks)")
    for _ in range(epochs):
        yield from (taskset.take(num_tasks) if num_tasks is not None else taskset)


async def play(taskset_id: str, urls: Sequence[str], group_size: int, num_tasks: Optional[int] = None,
               epochs: int = 1, *, concurrency: int = 8) -> PlayStats:
    """Play `epochs` passes over the taskset's tasks (the first `num_tasks`, or all), `group_size` rollouts
    each (the job's `rl.group_size`), at most `concurrency` rollouts at once, through the bridges at `urls`."""
    if group_size < 1 or concurrency < 1 or epochs < 1 or not urls:
        raise ValueError("group_size, concurrency and epochs must be positive, and at least one bridge URL given")
    env = load_env(taskset_id)
    async with bridge_http() as http:
        bridges = [BridgeClient(url, http) for url in urls]
        models = [await bridge.model() for bridge in bridges]
        player = Player(env, bridges, models, group_size, concurrency)
        async with env.serving():
            pending = set()
            for index, task in enumerate(_tasks(env.taskset, num_tasks, epochs)):
                if player.lost is not None:
                    break
                pending.add(asyncio.ensure_future(player.play_task(f"vf-{player.run}-{index}", task)))
                if len(pending) >= concurrency:  # enough tasks queued to keep `concurrency` rollouts going
                    _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.gather(*pending)  # rollouts in flight end (those after a lost bridge at once)
    if player.lost is not None:
        raise player.lost
    return player.stats
