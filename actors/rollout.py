"""Rollout workers: sample groups of completions from the newest policy and queue them for scoring.

Each worker is a Ray actor that loops until the job's stop flag is set: pull newer weights if
published, claim groups from the staleness gate, decode their `group_size` completions each in a
continuous batch, and submit every group to the reward queue (a distilling policy's: to its teacher queue,
`actors/teacher.py`) as soon as it is complete. It never
waits for the learner except when the staleness bound says any more samples would arrive too old.
Prompts are read as token ids from the file the controller saved, and the weight store is found by
name, so a worker Ray restarts gets both again with none of its constructor arguments held in the
object store. Prompts are drawn in seeded epochs, each worker its own share of an epoch.
With a multi-turn `env`, each completion is an episode (`episodes.MultiTurn`) whose tool calls
run on tool workers while the batch decodes other episodes. With `env.kind: verifiers` the worker
plays a taskset's tasks through its own OpenAI bridge instead of drawing data prompts
(`envs.taskset_source`), and evaluates on the taskset's held-out tasks.
The spare worker the job keeps for evaluation scores held-out completions with the job's rewards.
Its counters (samples, tokens, weight syncs, generation, submit and weight-sync seconds, the decode batch
while episodes wait on tools) live on Redis, in the policy's
`rollout_stats` hash, so a worker Ray restarts loses none of them.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, Hashable, List, Optional, Tuple

import ray
import torch

from rlplatform.actor_classes import LazyActorClass
from rlplatform.actors.completions import Completion
from rlplatform.actors.engine import ContinuousBatch, build_engine
from rlplatform.actors.episodes import MultiTurn, SingleTurn, WaitOccupancy, run_episodes
from rlplatform.actors.idle_episodes import ExpiredEpisode
from rlplatform.actors.openai_bridge import OpenAIBridge, serve_worker
from rlplatform.actors.rollout_spec import RolloutSpec
from rlplatform.config import EvalConfig, RewardSpec
from rlplatform.envs.rendering import Renderer
from rlplatform.envs.taskset_source import TasksetPlayer, play_held_out
from rlplatform.monitoring.eval_figures import evaluation_figures
from rlplatform.monitoring.watchdog import deadline_rule
from rlplatform.monitoring.parity_canary import CanaryCheck
from rlplatform.priority import set_cpu_priority
from rlplatform.rewards.registry import resolve
from rlplatform.rewards.scoring import Scorer
from rlplatform.scheduling.groups import GroupSchedule
from rlplatform.scheduling.ledger import AGENT, prompt_row
from rlplatform.scheduling.staleness import StalenessRule
from rlplatform.tokenization import Prompt, load_prompts
from rlplatform.transport.deadlines import Heartbeats, rollout_worker_label
from rlplatform.transport.redis_server import RECONNECT_S, connect
from rlplatform.transport.keys import PolicyKeys
from rlplatform.transport.reward_queue import RewardQueue
from rlplatform.transport.rollout_counters import RolloutCounterHash
from rlplatform.transport.samples import Sample
from rlplatform.transport.teacher_queue import TeacherQueue
from rlplatform.transport.tool_queue import ToolQueue
from rlplatform.transport.versions import VersionAnnouncements
from rlplatform.user_code import import_modules
from rlplatform.transport.weights import from_snapshot


POLL_S = 0.005  # the generation loop reads the stop flag and the published version at most this often
IDLE_WAIT_S = 0.01  # with nothing to decode, the loop waits this long at most for new weights before going round


@dataclass
class _OpenGroup:
    """A claimed prompt whose completions are still being decoded."""
    prompt: Prompt
    position: int  # the prompt ledger's
    completions: List[Optional[Completion]]


class RolloutWorker:
    def __init__(self, spec: RolloutSpec) -> None:
        rl, rollout, run, policy, index = spec.rl, spec.rollout, spec.run, spec.policy, spec.index
        torch.set_num_threads(rollout.num_threads)
        set_cpu_priority(spec.priority)
        torch.manual_seed(spec.seed + 1000 * (index + 1))
        self.index, self.policy, self.rl, self.rollout = index, policy, rl, rollout
        self.prompts = load_prompts(spec.prompts_path)
        transport = spec.transport
        self.engine = build_engine(rollout, spec.model_path, spec.dtype, spec.seed + index, spec.lora,
                                   deltas=transport.delta_full_every > 0)
        store = ray.get_actor(spec.weight_store) if spec.weight_store else None
        self.weights_in = transport.receiver(store, self.engine.device)  # weights.transport's worker end
        self.redis_url = spec.redis_url
        client = connect(spec.redis_url, wait_s=RECONNECT_S)  # a restart may meet the job's Redis restarting
        self.queue = RewardQueue(client, run)
        # where samples go to be scored: the reward queue, or a distilling policy's teacher queue before it
        self.scoring = TeacherQueue(client, run, policy) if spec.distilled else self.queue
        self.keys = PolicyKeys(run, policy)
        self.counters = RolloutCounterHash(client, self.keys.rollout_stats)
        self.schedule = GroupSchedule(client, run, policy, StalenessRule.of(rl))
        self.seed, self.chat_template = spec.seed, spec.chat_template
        self.env = spec.env
        self.idle_rule = deadline_rule(spec.monitoring)  # the bridge's, for agents' episodes
        self.episodes = self._episodes(client, run, spec.chat_template, rl.max_new_tokens)
        self.occupancy = WaitOccupancy()  # the decode batch while episodes wait on tools
        self._scorer = None  # the job's rewards, built on the first evaluation
        self._unreported_busy_s = 0.0
        self.heartbeats = Heartbeats(client, run)
        self.canary = CanaryCheck(client, self.keys.canary_reference, self.keys.canary_checks, spec.parity_every,
                                  index) if spec.parity_every else None  # the parity canary (`parity_canary`)
        self.label = rollout_worker_label(index, policy)
        self._polled_at = -POLL_S  # when the loop last read the stop flag and the published version (`_poll`)
        self._stop, self._published = False, None
        self.announcements = VersionAnnouncements(client, self.keys)

    def sync_weights(self, published: Optional[int] = None, beat: bool = False) -> int:
        """Load the newest published weights if they are newer than those held (`published`: the version the
        loop last read on Redis; else it is read now); returns the version held. With `beat` (the generation
        loop's calls) the load is told on the heartbeat hash: an evaluator or a teacher worker, whose loads come
        between long idle stretches, would otherwise be named silent once idle."""
        if not self._newer(self._read_published() if published is None else published):
            return self.engine.version
        newer = self.weights_in.newer(self.engine.version)
        if newer is not None:
            version, state_dict = newer
            if beat:
                self.heartbeats.beat(self.label, f"loading weights v{version}", self.engine.version)
            self.engine.load_weights(state_dict, version)
            received = sum(t.numel() * t.element_size() for t in state_dict.values())  # with LoRA, the adapters' alone
            self._count(weight_sync_bytes=received)
            if self.canary is not None and self.canary.due(version):
                self.canary.run(version, self.engine.score)
        return self.engine.version

    def _sync_counted(self) -> None:
        """`sync_weights` in the generation loop, counted when it loaded a newer version."""
        start, held = time.perf_counter(), self.version
        if self.sync_weights(self._published, beat=True) != held:
            self._count(weight_syncs=1, weight_sync_s=time.perf_counter() - start)

    def _episodes(self, client, run: str, chat_template: str, max_new_tokens: int):
        """How this worker's completions become episodes: single turns, or the job's multi-turn environment."""
        if not self.env.multi_turn:
            return SingleTurn()
        tools = ToolQueue(client, run)
        return MultiTurn(self.env, max_new_tokens, Renderer(self.engine.tokenizer, chat_template), tools,
                         tools.tool_keys.results(f"{self.policy}-{self.index}"))

    @property
    def version(self) -> int:
        return self.engine.version

    def join_weights(self, *args, **kwargs) -> None:
        """Take part in the weight transport's set-up (`WeightTransport.connect`; this engine's end)."""
        self.weights_in.join(*args, **kwargs)

    def run(self) -> None:
        """Generate and submit until the job's stop flag is set.

        Claimed groups join the decode batch whenever a quarter of its slots are free, and each
        group is submitted the step its last completion ends, so a long completion holds up only
        its own group. With `weight_swap: finish_then_swap` no group joins while newer weights
        wait; they load once the batch has drained.
        """
        batch = self.engine.decode_batch(self.rl.max_new_tokens, self.rl.temperature)
        capacity = self.rollout.prompts_per_batch
        open_groups: Dict[str, _OpenGroup] = {}
        in_flight = self.rollout.weight_swap == "in_flight"
        bridge = serve_worker(self.engine, self.rollout.openai_bridge, self.rl, self.policy, self.index,
                              chat_template=self.chat_template, reward_queue=self.queue,
                              counters=self.keys.rollout_stats,
                              admit=lambda group: self.schedule.admit(group, self.version),
                              taskset=self.env.plays_taskset, idle_rule=self.idle_rule,
                              on_expired=self._episodes_expired)
        self.schedule.taken_over(self.index)  # after a restart: the groups a predecessor left unsubmitted
        player = self._taskset_player(bridge, capacity)
        while not self._poll():
            self.heartbeats.beat(self.label, "generating", self.version)
            if in_flight or not batch:
                self._sync_counted()
            if self.version < 0:
                time.sleep(0.05)
                continue
            if player is not None and player.error is not None:
                raise player.error
            free = capacity - len(open_groups)
            if self.rollout.source == "dataset" and player is None and free >= max(1, capacity // 4) and \
                    (in_flight or not self._newer(self._published)):
                self._admit(batch, open_groups, free)
            if bridge is not None and (in_flight or not self._newer(self._published)):
                bridge.admit(batch)
            self.occupancy.tick(self.episodes.waiting, len(batch))
            if not batch:
                self._await_weights(IDLE_WAIT_S)
                if not self.episodes.waiting:
                    continue
            start = time.perf_counter()
            finished = self._decode(batch)
            if bridge is not None:
                finished = bridge.collect(finished)
            finished = self.episodes.advance(batch, finished)
            self._unreported_busy_s += time.perf_counter() - start
            samples = self._close_groups(open_groups, finished)
            if samples:
                self._submit(samples)
        if player is not None:
            player.stop()
        if bridge is not None:
            bridge.stop()
        self._flush_counts()

    def _taskset_player(self, bridge: Optional[OpenAIBridge], groups_at_once: int) -> Optional[TasksetPlayer]:
        """With `env.kind: verifiers`, this worker's player of the taskset, started."""
        if not self.env.plays_taskset:
            return None
        player = TasksetPlayer(self.env, bridge.url, self.schedule, self.index, self.rl.group_size,
                               groups_at_once=groups_at_once, seed=self.seed, version=lambda: self.version)
        player.start()
        return player

    def _flush_counts(self) -> None:
        """Generation time and wait counts since the last submit, which would otherwise be lost at the stop."""
        self.occupancy.tick(0, 0)  # closes an idle stretch still open
        self._count(busy_s=self._unreported_busy_s, **self.occupancy.take_counts())
        self._unreported_busy_s = 0.0

    def _decode(self, batch: ContinuousBatch) -> List[Tuple[Hashable, Completion]]:
        """One decode step (none while the batch is empty), counted while episodes wait on tools."""
        if not batch:
            return []
        self.occupancy.decoded(len(batch))
        return batch.step()

    def _submit(self, samples: List[Sample]) -> None:
        """Queue complete groups for scoring; the queue counts their samples and tokens as it takes them."""
        start = time.perf_counter()
        self.scoring.submit(samples, counters=self.keys.rollout_stats,
                            claims=self.schedule.submission(sorted({s.group_id for s in samples})))
        self._count(busy_s=self._unreported_busy_s, submit_s=time.perf_counter() - start,
                    **self.occupancy.take_counts())
        self._unreported_busy_s = 0.0

    def _episodes_expired(self, expired: List[ExpiredEpisode]) -> None:
        """Agent episodes the bridge dropped for their agent's silence: counted, and told to the job's alert."""
        self._count(agent_episodes_expired=len(expired))
        self.queue.client.rpush(self.keys.agent_episodes_expired,
                                *[json.dumps({**gone.as_dict(), "worker": self.label}) for gone in expired])

    def _count(self, **values: float) -> None:
        """Add to the policy's rollout counters on Redis (read by the monitor and the summary)."""
        self.counters.add(**values)

    def _poll(self) -> bool:
        """Whether the job's stop flag is set. It and the published version (kept for the loop's weight checks)
        are read in one round trip, at most every `POLL_S`, instead of two round trips every decode step (a few
        milliseconds each on CPU)."""
        now = time.monotonic()
        if now - self._polled_at >= POLL_S:
            self._polled_at = now
            stop, published = self.queue.client.pipeline(transaction=False).exists(self.queue.keys.stop) \
                .get(self.keys.version).execute()
            self._stop, self._published = bool(stop), None if published is None else int(published)
        return self._stop

    def _await_weights(self, timeout_s: float) -> None:
        """With nothing to decode: wait until a new version is announced (at most `timeout_s`), and take it as
        the published one; the loop loads it and claims groups for it without waiting for its next poll."""
        announced = self.announcements.wait(timeout_s)
        if announced is not None and (self._published is None or announced > self._published):
            self._published = announced

    def _read_published(self) -> Optional[int]:
        """The version mirrored on Redis (None before the first)."""
        published = self.queue.client.get(self.keys.version)
        return None if published is None else int(published)

    def _newer(self, published: Optional[int]) -> bool:
        """Whether `published` is newer than the weights held."""
        return published is not None and published > self.engine.version

    def _admit(self, batch: ContinuousBatch, open_groups: Dict[str, _OpenGroup], wanted: int) -> None:
        """Start as many of `wanted` groups as the staleness rule lets the weights held start, on the
        ledger's next prompts."""
        for group_id, position in self.schedule.issue(self.index, wanted, self.version):
            prompt = self.prompts[prompt_row(position, len(self.prompts), self.seed)]
            open_groups[group_id] = _OpenGroup(prompt, position, [None] * self.rl.group_size)
            self.episodes.start(batch, [(group_id, i) for i in range(self.rl.group_size)], prompt)

    def _close_groups(self, open_groups: Dict[str, _OpenGroup],
                      finished: List[Tuple[Hashable, Completion]]) -> List[Sample]:
        """Record finished completions; the samples of every group now complete."""
        closed = []
        for (group_id, i), completion in finished:
            group = open_groups[group_id]
            group.completions[i] = completion
            if all(c is not None for c in group.completions):
                closed.append((group_id, open_groups.pop(group_id)))
        if not closed:
            return []
        samples, now = [], time.time()
        for group_id, group in closed:
            samples += [self._sample(f"{group_id}/{i}", group_id, group.prompt, c, now, position=group.position)
                        for i, c in enumerate(group.completions)]
        counts = self.episodes.take_counts()  # multi-turn: turns, tool calls, observation tokens
        if counts:
            self._count(**counts)
        return samples

    def _sample(self, sample_id: str, group_id: str, prompt: Prompt, c: Completion, now: float, *,
                position: int = AGENT) -> Sample:
        """`position`: the prompt ledger's position of the group's prompt (`AGENT`: none, a held-out prompt)."""
        return Sample(sample_id=sample_id, group_id=group_id, policy=self.policy, prompt=prompt.text,
                      completion=c.text, prompt_ids=c.prompt_ids, completion_ids=c.completion_ids,
                      behaviour_logprobs=c.logprobs, token_versions=c.versions, row={**prompt.row, **c.episode},
                      created_at=now, completion_mask=c.completion_mask, routed_experts=c.routed_experts,
                      prompt_position=position)

    def evaluate_snapshot(self, snapshot: Dict, prompts: List[Prompt], config: EvalConfig, rewards: List[RewardSpec],
                          imports: List[str]) -> Dict:
        """Evaluation figures of weights not published as a version (SFT in progress). They are held
        as version -1, so the first published version replaces them."""
        self.engine.load_weights(from_snapshot(snapshot), -1)
        return self.evaluate(prompts, config, rewards, imports)

    def evaluate_latest(self, prompts: List[Prompt], config: EvalConfig, rewards: List[RewardSpec],
                        imports: List[str]) -> tuple:
        """(version, evaluation figures) of the newest published weights on `prompts`."""
        version = self.sync_weights()
        return version, self.evaluate(prompts, config, rewards, imports)

    def evaluate(self, prompts: List[Prompt], config: EvalConfig, rewards: List[RewardSpec],
                 imports: List[str]) -> Dict:
        """`config.samples_per_prompt` completions per prompt (greedy, or sampled at `config.temperature`),
        scored by the job's rewards in this process: the figures of `evaluation_figures`."""
        if self._scorer is None:
            import_modules(imports)
            self._scorer = Scorer(resolve(rewards))
        temperature = 0.0 if config.greedy else config.temperature
        if self.env.plays_taskset:
            samples = self._play_held_out(config, temperature)
            return evaluation_figures(self._scorer.score(samples), config.samples_per_prompt, self._scorer.rewards,
                                      config.pass_reward)
        samples, now = [], time.time()
        for start in range(0, len(prompts), config.batch_size):
            chunk = prompts[start:start + config.batch_size]
            if self.env.multi_turn:
                outputs = run_episodes(self.episodes, self.engine.decode_batch(config.max_new_tokens, temperature),
                                       chunk, config.samples_per_prompt)
            else:
                outputs = self.engine.generate([p.ids for p in chunk], config.samples_per_prompt,
                                               config.max_new_tokens, temperature)
            for i, (prompt, completions) in enumerate(zip(chunk, outputs), start):
                samples += [self._sample(f"eval/{i}/{j}", f"eval/{i}", prompt, c, now)
                            for j, c in enumerate(completions)]
        scored = self._scorer.score(samples) if samples else []
        return evaluation_figures(scored, config.samples_per_prompt, self._scorer.rewards, config.pass_reward)

    def _play_held_out(self, config: EvalConfig, temperature: float) -> List[Sample]:
        """The taskset's held-out tasks, `config.samples_per_prompt` episodes each, played through a bridge of
        this engine on loopback while this thread decodes; the finished episodes, kept out of the queue."""
        samples: List[Sample] = []
        bridge = OpenAIBridge(self.engine, self.policy, self.chat_template, temperature, config.max_new_tokens,
                              submit=samples.extend, admit=lambda group: AGENT)
        port = bridge.start("127.0.0.1", 0)
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="held-out") as pool:
                play = pool.submit(asyncio.run, play_held_out(self.env, f"http://127.0.0.1:{port}/v1",
                                                              config.samples_per_prompt))
                batch = self.engine.decode_batch(config.max_new_tokens, temperature)
                while not play.done():
                    bridge.admit(batch)
                    bridge.collect(batch.step() if batch else [])
                    if not batch:
                        time.sleep(0.005)
                play.result()  # its error, if it failed
        finally:
            bridge.stop()
        return samples


RolloutActor = LazyActorClass(RolloutWorker)
