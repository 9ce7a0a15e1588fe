"""A verifiers taskset as a job's own rollout source (`env.kind: verifiers`): each rollout worker plays it.

Data flow: the prompt ledger issues a group, which claims staleness capacity like any group -> its
data position picks a training task (the taskset's tasks but `env.test_tasks` held out by a fixed
seeded draw; each pass over them a seeded shuffle, as data rows are picked) -> `rl.group_size` rollouts of the task, run by
verifiers' own env machinery with every model call sent to this worker's OpenAI bridge, so each
rollout is one token-exact episode (`verifiers_rollouts.Player`) -> finished into the ledger's group
with the task's reward in its row (`verifiers_reward`, and each reward function's score) -> the
reward queue and the learner. A restarted worker's unsubmitted groups are issued again, and
checkpoints keep the ledger, so a resume goes on from the tasks trained. `play_held_out` plays the
held-out tasks once per evaluation, its episodes kept out of the queue and scored by the job's rewards.
"""

from __future__ import annotations

import asyncio
import random
import threading
from typing import Callable, List, Optional, Tuple

from rlplatform.config import EnvConfig
from rlplatform.envs.verifiers_rollouts import BridgeClient, Player, bridge_http, load_env
from rlplatform.scheduling.groups import GroupSchedule
from rlplatform.scheduling.ledger import prompt_row

POLL_S = 0.02  # how often the player looks for room to start groups, and for its stop
SPLIT_SEED = 0  # the held-out tasks' draw: fixed, so every worker and the evaluator agree


def split_tasks(env, test_tasks: int) -> Tuple[List, List]:
    """(training tasks, held-out tasks): `test_tasks` of the taskset's tasks held out, drawn by a fixed seeded
    shuffle (the same in every process), so a taskset listed in order of difficulty is held out evenly."""
    if not env.taskset.bounded:
        raise ValueError("env.kind verifiers needs a finite taskset: this one's tasks never end")
    tasks = list(env.taskset)
    if len(tasks) <= test_tasks:
        raise ValueError(f"the taskset has {len(tasks)} tasks, not more than env.test_tasks {test_tasks}: "
                         "nothing is left to train on")
    order = list(range(len(tasks)))
    random.Random(SPLIT_SEED).shuffle(order)
    held_out = set(order[:test_tasks])
    return ([t for i, t in enumerate(tasks) if i not in held_out], [t for i, t in enumerate(tasks) if i in held_out])


class TasksetPlayer:
    """Rollout worker `worker`'s play of the taskset on a thread of its own: as many groups at once as
    `groups_at_once`, each issued by `schedule` to the worker holding weights `version()` (none while it is
    below 0)."""

    def __init__(self, env: EnvConfig, url: str, schedule: GroupSchedule, worker: int, group_size: int,
                 *, groups_at_once: int, seed: int, version: Callable[[], int]) -> None:
        self.env, self.url, self.schedule, self.worker = env, url, schedule, worker
        self.group_size, self.groups_at_once, self.seed, self.version = group_size, groups_at_once, seed, version
        self.error: Optional[BaseException] = None  # what ended the play early
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="taskset-player", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        try:
            asyncio.run(self._play())
        except BaseException as err:  # the worker loop raises it
            self.error = err

    async def _play(self) -> None:
        env = load_env(self.env.taskset, self.env.taskset_args)
        train, _ = split_tasks(env, self.env.test_tasks)
        async with bridge_http() as http:
            bridge = BridgeClient(self.url, http)
            player = Player(env, [bridge], [await bridge.model()], self.group_size,
                            self.groups_at_once * self.group_size)
            in_play: set = set()
            async with env.serving():
                while not self._stop.is_set():
                    in_play = {group for group in in_play if not group.done()}
                    version = self.version()
                    if version >= 0 and len(in_play) < self.groups_at_once:
                        for group_id, position in self.schedule.issue(self.worker, self.groups_at_once - len(in_play),
                                                                       version):
                            task = train[prompt_row(position, len(train), self.seed)]
                            in_play.add(asyncio.ensure_future(self._group(player, group_id, task)))
                    if player.lost is not None:
                        raise player.lost
                    await asyncio.sleep(POLL_S)
                for group in in_play:  # the worker stops: rollouts in flight end with it
                    group.cancel()
                await asyncio.gather(*in_play, return_exceptions=True)

    async def _group(self, player: Player, group_id: str, task) -> None:
        await player.play_task(group_id, task)
        self.schedule.submitted([group_id])  # every episode finished or discarded: no longer this worker's to lose


async def play_held_out(env_config: EnvConfig, url: str, rollouts_per_task: int) -> None:
    """Each held-out task `rollouts_per_task` times through the bridge at `url`, finished into group
    `eval/<k>` (the bridge's `submit` keeps them)."""
    env = load_env(env_config.taskset, env_config.taskset_args)
    _, held_out = split_tasks(env, env_config.test_tasks)
    async with bridge_http() as http:
        bridge = BridgeClient(url, http)
        player = Player(env, [bridge], [await bridge.model()], rollouts_per_task, 8 * rollouts_per_task)
        async with env.serving():
            await asyncio.gather(*(player.play_task(f"eval/{k}", task) for k, task in enumerate(held_out)))
        if player.lost is not None:
            raise player.lost
