"""Episodes on a continuous decode batch: the rollout worker's side of multi-turn environments.

`SingleTurn` (the default) starts each prompt's completions and passes finished ones through.
`MultiTurn` keeps one token sequence per episode: the model's tokens with their behaviour
log-probs and versions (completion_mask 1), and the observation tokens the environment's
replies add (mask 0, log-prob 0.0, the version of the model token before them). Each model turn
goes to the episode's environment; tool calls go to the job's tool queue and the episode leaves
the batch until every result is back on this worker's result stream, while the batch keeps
decoding the other episodes. An episode ends when its environment says so, at `env.max_turns`
model turns, or when `env.max_tokens` leaves no room (then `truncated`); it comes back as one
`Completion` whose `episode` fields (the environment's, and turns, tool_calls, truncated) join the row.
With a chat template each finished episode's tokens are checked against its conversation rendered
whole (`Renderer.first_mismatch`): counted (token_checks, token_mismatches), and by
`env.on_token_mismatch` also trained on no token (drop: its completion mask all 0, its reward still
in its group) or stopping the job (fail).
`WaitOccupancy` counts what the decode batch does while episodes wait on tools.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from dataclasses import KW_ONLY, dataclass, field
from typing import Dict, Hashable, List, Optional, Tuple

from rlplatform.actors.completions import Completion
from rlplatform.actors.decode_batch import DecodeBatch
from rlplatform.actors.token_trace import TokenTrace
from rlplatform.config import EnvConfig
from rlplatform.envs.environment import Environment, Message, Reply, environment_factory
from rlplatform.envs.rendering import Renderer
from rlplatform.tokenization import Prompt
from rlplatform.transport.tool_queue import ToolCall, ToolQueue, ToolResult

Finished = List[Tuple[Hashable, Completion]]


class SingleTurn:
    """One completion per episode, straight from the batch."""
    waiting = 0  # episodes waiting on tools

    def start(self, batch: DecodeBatch, keys: List[Hashable], prompt: Prompt) -> None:
        batch.add([prompt.ids] * len(keys), keys)

    def advance(self, batch: DecodeBatch, finished: Finished) -> Finished:
        return finished

    def take_counts(self) -> Dict[str, float]:
        return {}


@dataclass
class _Episode:
    tag: str  # unique in the job: prefixes its tool call ids
    env: Environment
    prompt_ids: List[int]
    messages: List[Message]  # the conversation so far, as the chat template renders it
    prompt_turns: int  # the first messages, the prompt's
    _: KW_ONLY
    trace: TokenTrace = field(default_factory=TokenTrace)  # every token after the prompt
    turns: int = 0
    tool_calls: int = 0
    malformed_calls: int = 0
    unknown_tool_calls: int = 0
    results: Dict[str, Optional[ToolResult]] = field(default_factory=dict)  # call id -> result, in call order


class MultiTurn:
    def __init__(self, config: EnvConfig, max_new_tokens: int, renderer: Renderer, tools: ToolQueue,
                 reply_to: str) -> None:
        self.make_env = environment_factory(config)
        self.on_token_mismatch = config.on_token_mismatch
        self.max_turns, self.max_new_tokens = config.max_turns, max_new_tokens
        self.max_tokens = config.completion_tokens(max_new_tokens)
        self.renderer, self.tools, self.reply_to = renderer, tools, reply_to
        self.episodes: Dict[Hashable, _Episode] = {}
        self.calls: Dict[str, Hashable] = {}  # outstanding tool call id -> episode key
        self._tag, self._serial = uuid.uuid4().hex[:12], 0  # call ids stay unique across restarts and evaluations
        self.counts: Counter = Counter()

    @property
    def waiting(self) -> int:
        return len(set(self.calls.values()))

    def start(self, batch: DecodeBatch, keys: List[Hashable], prompt: Prompt) -> None:
        for key in keys:
            env = self.make_env()
            messages = env.start(prompt.row)
            self._serial += 1
            episode = _Episode(f"{self._tag}-{self._serial}", env, self.renderer.prompt_ids(messages), messages,
                               len(messages))
            self.episodes[key] = episode
            batch.add([episode.prompt_ids], [key], max_new_tokens=min(self.max_new_tokens, self.max_tokens))

    def advance(self, batch: DecodeBatch, finished: Finished) -> Finished:
        """Episodes that ended: hand each finished model turn to its environment, and each complete set
        of tool results; episodes that go on rejoin the batch."""
        done: Finished = []
        for key, turn in finished:
            episode = self.episodes[key]
            self._add_turn(episode, turn)
            self._answer(key, episode, episode.env.step(turn.text), batch, done)
        for result in self.tools.read_results(self.reply_to):
            key = self.calls.pop(result.call_id, None)
            if key is None:  # a second delivery of a result already used
                continue
            episode = self.episodes[key]
            episode.results[result.call_id] = result
            if all(r is not None for r in episode.results.values()):
                results, episode.results = list(episode.results.values()), {}
                self._answer(key, episode, episode.env.tool_results(results), batch, done)
        return done

    def take_counts(self) -> Dict[str, float]:
        """Counters of the episodes ended since the last call: episodes, episodes_truncated, and their turns,
        tool_calls, observation_tokens, malformed_calls and unknown_tool_calls."""
        counts, self.counts = dict(self.counts), Counter()
        return counts

    def _add_turn(self, episode: _Episode, turn: Completion) -> None:
        episode.trace.add_model_tokens(turn)
        episode.turns += 1
        episode.messages.append({"role": "assistant", "content": turn.text})

    def _answer(self, key: Hashable, episode: _Episode, reply: Reply, batch: DecodeBatch, done: Finished) -> None:
        """Act on the environment's reply: end the episode, send its tool calls, or show the observation."""
        episode.malformed_calls += reply.malformed_calls
        episode.unknown_tool_calls += reply.unknown_tool_calls
        if reply.done:
            done.append((key, self._finish(key, episode, reply.fields, truncated=False)))
        elif episode.turns >= self.max_turns or len(episode.trace.ids) >= self.max_tokens:
            done.append((key, self._finish(key, episode, reply.fields, truncated=True)))
        elif reply.tool_calls:
            self._call_tools(key, episode, reply)
        elif not self._observe(key, episode, reply.observation, batch):
            done.append((key, self._finish(key, episode, reply.fields, truncated=True)))

    def _call_tools(self, key: Hashable, episode: _Episode, reply: Reply) -> None:
        now = time.time()
        calls = [ToolCall(f"{episode.tag}/t{episode.turns}/c{i}", call.name, call.arguments, self.reply_to, now)
                 for i, call in enumerate(reply.tool_calls)]
        episode.results = {call.call_id: None for call in calls}
        self.calls.update({call.call_id: key for call in calls})
        episode.tool_calls += len(calls)
        self.tools.submit(calls)

    def _observe(self, key: Hashable, episode: _Episode, observation: List[Message], batch: DecodeBatch) -> bool:
        """Append the observation's tokens and start the next model turn; False when the budget has no room."""
        ids = self.renderer.observation_ids(episode.messages, episode.trace.last_turn(), observation)
        room = self.max_tokens - len(episode.trace.ids) - len(ids)
        if room < 1:
            return False
        episode.trace.add_observation(ids)
        episode.messages += observation
        batch.add([episode.prompt_ids + episode.trace.ids], [key], max_new_tokens=min(self.max_new_tokens, room))
        return True

    def _finish(self, key: Hashable, episode: _Episode, fields: Dict, truncated: bool) -> Completion:
        del self.episodes[key]
        self.counts.update(episodes=1, episodes_truncated=int(truncated), turns=episode.turns,
                           tool_calls=episode.tool_calls, observation_tokens=episode.trace.observation_tokens,
                           malformed_calls=episode.malformed_calls, unknown_tool_calls=episode.unknown_tool_calls)
        trace = episode.trace
        text = self.renderer.tokenizer.decode(trace.ids, skip_special_tokens=True)
        fields = {**fields, "turns": episode.turns, "tool_calls": episode.tool_calls, "truncated": truncated}
        mask = trace.mask
        if self._tokens_differ(episode):
            fields["token_mismatch"] = True
            if self.on_token_mismatch == "drop":
                mask = [0] * len(mask)
        return Completion(episode.prompt_ids, trace.ids, text, trace.logprobs, trace.versions,
                          completion_mask=mask, episode=fields)

    def _tokens_differ(self, episode: _Episode) -> bool:
        """The exact-token check, counted: whether the episode's tokens depart from its conversation rendered
        whole by the chat template; with `env.on_token_mismatch: fail` such an episode raises."""
        ids = episode.prompt_ids + episode.trace.ids
        position = self.renderer.first_mismatch(episode.messages, episode.prompt_turns, ids)
        self.counts.update(token_checks=int(self.renderer.chat), token_mismatches=int(position is not None))
        if position is not None and self.on_token_mismatch == "fail":
            decode = self.renderer.tokenizer.decode
            raise TokenMismatch(f"env.on_token_mismatch: fail: an episode's token {position} is "
                                f"{decode(ids[position:position + 1])!r} where its conversation, rendered whole by the "
                                f"chat template, has another (after {decode(ids[max(position - 20, 0):position])!r}); "
                                "the template renders turns differently once later turns follow")
        return position is not None


class TokenMismatch(RuntimeError):
    """An episode's tokens are not its conversation's, and `env.on_token_mismatch` is fail."""


class WaitOccupancy:
    """While at least one episode waits on a tool: the decode steps taken and the sequences they decoded
    (their ratio is the batch's occupancy while waiting), and the wall time the batch sat empty."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self._waiting = 0
        self._idle_since: Optional[float] = None

    def tick(self, waiting: int, sequences: int) -> None:
        """Called once per pass of the worker loop with the episodes waiting and the batch's rows."""
        now = time.perf_counter()
        if self._idle_since is not None:
            self.counts["idle_s_while_waiting"] += now - self._idle_since
        self._waiting = waiting
        self._idle_since = now if waiting and not sequences else None

    def decoded(self, sequences: int) -> None:
        """Called for each decode step the loop takes, of `sequences` rows."""
        if self._waiting:
            self.counts.update(decode_steps_while_waiting=1, sequences_while_waiting=sequences)

    def take_counts(self) -> Dict[str, float]:
        """decode_steps_while_waiting, sequences_while_waiting and idle_s_while_waiting since the last call."""
        counts, self.counts = dict(self.counts), Counter()
        return counts


def run_episodes(episodes, batch: DecodeBatch, prompts: List[Prompt], samples_per_prompt: int,
                 poll_s: float = 0.005) -> List[List[Completion]]:
    """Every prompt's `samples_per_prompt` episodes run to their end on `batch` (evaluation)."""
    for i, prompt in enumerate(prompts):
        episodes.start(batch, [(i, j) for j in range(samples_per_prompt)], prompt)
    ended: Dict[Hashable, Completion] = {}
    while len(ended) < len(prompts) * samples_per_prompt:
        finished = episodes.advance(batch, batch.step() if batch else [])
        ended.update(finished)
        if not batch and not finished:
            time.sleep(poll_s)
    return [[ended[(i, j)] for j in range(samples_per_prompt)] for i in range(len(prompts))]
