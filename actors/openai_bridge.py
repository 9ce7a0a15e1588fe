"""The OpenAI-compatible bridge: agents written against the OpenAI client sample from a rollout worker.

An aiohttp server on its own thread answers `POST /v1/chat/completions` and `GET /v1/models` (the
model is the policy). Each request's prompt joins the worker's continuous decode batch (`admit`,
called by the worker loop between steps) and its completions come back through `collect`; replies
carry their token ids and weight versions. Requests with an `X-Episode-Id` header grow one token
sequence per episode (`bridge_episodes.py`); `POST /v1/episodes/{id}/finish` with `{"group", "row"}`
turns it into a `Sample` for the reward queue, like any rollout; `DELETE /v1/episodes/{id}` drops it.
An episode whose agent sends nothing past the idle deadline (`idle_episodes.py`) is dropped and reported
(`on_expired`); the agent's later requests for it are answered 410.

Finished episodes are counted with the worker's generated samples and tokens (the policy's rollout
stats), so the job's balance (generated = trained + dropped + unused) holds with them. An agent's
group enters the job's schedule when its first episode finishes (`admit`: the prompt ledger opens it
and it claims staleness capacity like an issued group); while the staleness rule allows no more
groups in play, that finish is answered 429 and the episode kept for the agent to finish again later.
A finish into a group that has ended (trained, dropped, or expired while its agent was away) is answered
410 and the episode kept, to be finished into a new group.
A group's ends (trained, dropped, expired) are the ledger's, as for any group; having no data
position, it is never issued again.

Requests are bounded (`rollout.openai_bridge`: prompt tokens, `max_tokens`, `n`, a finite temperature: 400;
the body's size: 413; chat requests in progress at once: 429), all before any work is done,
and, when the worker's environment holds a key (`api_key_env`), must carry it as a bearer token; a
bridge that listens beyond the loopback interface will not start without one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import itertools
import math
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Dict, Hashable, List, Optional, Set, Tuple

import ray
from aiohttp import web

from rlplatform.actors.bridge_episodes import ChatRenderer, Episode, ExtensionError
from rlplatform.actors.completions import Completion
from rlplatform.actors.decode_batch import DecodeBatch
from rlplatform.actors.engine import TransformersEngine
from rlplatform.actors.idle_episodes import ExpiredEpisode, IdleEpisodes
from rlplatform.config import OpenAIBridgeConfig, RLConfig
from rlplatform.monitoring.watchdog import HangRule
from rlplatform.preflight import is_loopback
from rlplatform.scheduling.groups import GroupEnded
from rlplatform.transport.bridge_protocol import DISCARD_ROUTE, EPISODE_HEADER, FINISH_ROUTE, bridge_status_field
from rlplatform.transport.reward_queue import RewardQueue
from rlplatform.transport.samples import Sample

# request fields whose effect the recorded log-probs would not reflect, with the value that means "off"
_UNSUPPORTED = {"stream": False, "stop": None, "top_p": 1, "top_logprobs": 0, "frequency_penalty": 0,
                "presence_penalty": 0, "logit_bias": None, "tools": None, "response_format": None}
STOP_WAIT_S = 5.0  # the longest a stopping bridge waits for requests still being answered
SWEEP_EVERY_S = 1.0  # how often held episodes are checked against the idle deadline


class RequestError(Exception):
    """A request the bridge refuses: answered with `status` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass(frozen=True)
class BridgeKey:
    """The decode batch key of one choice of one bridge request."""
    request: int
    choice: int


@dataclass
class ChatParams:
    messages: List[Dict[str, str]]
    n: int
    max_tokens: int
    temperature: float
    logprobs: bool


@dataclass
class _Generation:
    """A request's prompt waiting for, or decoding, its `n` completions."""
    key: int
    prompt_ids: List[int]
    params: ChatParams
    future: asyncio.Future
    completions: List[Optional[Completion]] = field(default_factory=list)


class OpenAIBridge:
    """The endpoint of one rollout worker's engine for policy `policy`; `submit` queues finished episodes."""

    def __init__(self, engine: TransformersEngine, policy: str, chat_template: str, temperature: float,
                 max_new_tokens: int, *, submit: Callable[[List[Sample]], None], admit: Callable[[str], Optional[int]],
                 limits: OpenAIBridgeConfig = OpenAIBridgeConfig(), api_key: Optional[str] = None,
                 idle_rule: Optional[HangRule] = None,
                 on_expired: Callable[[List[ExpiredEpisode]], None] = lambda expired: None) -> None:
        """`admit(group)`: the group's prompt position once it is (now) in the job's schedule (-1: an agent's own
        group), None while there is no room for it (`GroupEnded` when it ended);
        `limits`: the request bounds of `rollout.openai_bridge`; `api_key`: the bearer token requests must carry
        (None: any request is served); `idle_rule`: the hang rule that drops episodes whose agent went silent,
        each batch of them told to `on_expired` (None: episodes are held until their agent ends them)."""
        self.policy, self.submit, self.limits, self.api_key = policy, submit, limits, api_key
        self.admit_group, self.on_expired = admit, on_expired
        self.idle = IdleEpisodes(idle_rule)
        self.temperature, self.max_new_tokens = temperature, max_new_tokens  # the job's rl settings
        self.renderer = ChatRenderer(engine.tokenizer, chat_template)
        self.stop_ids = set(engine.stop_ids)
        self.episodes: Dict[str, Episode] = {}  # touched on the server's thread only
        self.busy_episodes: Set[str] = set()  # episodes with a turn in progress
        self._pending: "queue.SimpleQueue[_Generation]" = queue.SimpleQueue()  # server thread -> worker loop
        self._decoding: Dict[int, _Generation] = {}  # worker loop only
        self._keys = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._runner: Optional[web.AppRunner] = None
        self._thread: Optional[threading.Thread] = None
        self._announced: Optional[Tuple[RewardQueue, str]] = None  # (queue, job status field) naming the URL
        self.url: Optional[str] = None  # where it serves, once announced
        self._in_progress = 0  # chat requests being answered (server thread only)
        self._stopping = False  # set once `stop` begins: requests arriving on open connections get 503 at once
        self._sweeper: Optional[asyncio.Task] = None

    # the worker loop's side
    def admit(self, batch: DecodeBatch) -> None:
        """Add the requests that arrived since the last call to `batch`."""
        while not self._pending.empty():
            generation = self._pending.get_nowait()
            params = generation.params
            generation.completions = [None] * params.n
            self._decoding[generation.key] = generation
            batch.add([generation.prompt_ids] * params.n, [BridgeKey(generation.key, i) for i in range(params.n)],
                      params.max_tokens, params.temperature)

    def collect(self, finished: List[Tuple[Hashable, Completion]]) -> List[Tuple[Hashable, Completion]]:
        """Answer the requests whose completions are all done; returns the finished rows that are not the bridge's."""
        others = []
        for key, completion in finished:
            if not isinstance(key, BridgeKey):
                others.append((key, completion))
                continue
            generation = self._decoding[key.request]
            generation.completions[key.choice] = completion
            if all(c is not None for c in generation.completions):
                del self._decoding[key.request]
                self._loop.call_soon_threadsafe(_resolve, generation.future, generation.completions)
        return others

    # the server
    def start(self, host: str, port: int) -> int:
        """Serve on `host`:`port` (0: a free port) from a background thread; returns the port."""
        app = web.Application(middlewares=[self._closing_when_stopping, _openai_errors, self._authorised],
                              client_max_size=self.limits.max_body_bytes)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1" + FINISH_ROUTE, self._finish)
        app.router.add_delete("/v1" + DISCARD_ROUTE, self._discard)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=STOP_WAIT_S)
        self._loop.run_until_complete(self._runner.setup())
        try:
            self._loop.run_until_complete(web.TCPSite(self._runner, host, port).start())
        except OSError as err:
            raise RuntimeError(f"rollout.openai_bridge: cannot listen on {host}:{port} ({err.strerror}); "
                               "choose another rollout.openai_bridge.port") from None
        if self.idle.rule is not None:
            self._sweeper = self._loop.create_task(self._sweep_idle())
        self._thread = threading.Thread(target=self._loop.run_forever, name="openai-bridge", daemon=True)
        self._thread.start()
        return self._runner.addresses[0][1]

    def announce(self, reward_queue: RewardQueue, name: str, url: str) -> None:
        """Print `url` and show it as field `name` of the job status (`rlp status`) until `stop`."""
        reward_queue.client.hset(reward_queue.keys.status, name, url)
        self._announced, self.url = (reward_queue, name), url
        print(f"{name}: OpenAI-compatible endpoint at {url}", flush=True)

    def stop(self) -> None:
        """Stop serving; requests still waiting are answered 503."""
        if self._announced is not None:
            reward_queue, name = self._announced
            reward_queue.client.hdel(reward_queue.keys.status, name)
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    async def _shutdown(self) -> None:
        self._stopping = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        for generation in list(self._decoding.values()) + _drain(self._pending):
            if not generation.future.done():
                generation.future.set_exception(RequestError(503, "the rollout worker stopped", "unavailable"))
        await self._runner.cleanup()

    @web.middleware
    async def _closing_when_stopping(self, request: web.Request, handler) -> web.StreamResponse:
        """While the bridge stops, each response closes its connection: a client retrying on a kept-alive
        one would otherwise hold the server's graceful shutdown open."""
        response = await handler(request)
        if self._stopping:
            response.force_close()
        return response

    @web.middleware
    async def _authorised(self, request: web.Request, handler) -> web.StreamResponse:
        """With a key, every route answers 401 to a request that does not carry it as its bearer token."""
        if self.api_key is not None:
            sent = request.headers.get("Authorization", "")
            if not hmac.compare_digest(sent.encode(), f"Bearer {self.api_key}".encode()):
                raise RequestError(401, "missing or wrong API key: send the key of the worker's "
                                        f"${self.limits.api_key_env} as 'Authorization: Bearer <key>'",
                                   "invalid_api_key")
        return await handler(request)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.policy, "object": "model", "created": 0, "owned_by": "rlplatform"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        if self._in_progress >= self.limits.max_requests:
            raise RequestError(429, f"{self._in_progress} requests are in progress on this worker, as many as it "
                                    f"takes (rollout.openai_bridge.max_requests); retry later", "rate_limit_exceeded")
        self._in_progress += 1
        try:
            return await self._answer(request)
        finally:
            self._in_progress -= 1

    async def _answer(self, request: web.Request) -> web.Response:
        body = await _json_body(request, self.limits.max_body_bytes)
        params = parse_chat(body, self.policy, self.temperature, self.max_new_tokens, self.limits)
        episode_id = request.headers.get(EPISODE_HEADER)
        if episode_id is None:
            text = self.renderer.text(params.messages)
            prompt_ids = self._within_limit(self.renderer.prompt_ids(text, params.messages))
            completions = await self._generate(prompt_ids, params)
        else:
            prompt_ids, completions = await self._episode_turn(episode_id, params, request.remote or "")
        return web.json_response(self._response(prompt_ids, completions, params.logprobs))

    async def _episode_turn(self, episode_id: str, params: ChatParams,
                            client: str) -> Tuple[List[int], List[Completion]]:
        """A reply within episode `episode_id`: it starts the episode or extends its token sequence."""
        self._not_expired(episode_id)
        if params.n != 1 or params.temperature != self.temperature:
            raise RequestError(400, f"episode {episode_id}: episode requests take n=1 and the job's "
                                    f"rl.temperature {self.temperature} (the learner scores tokens at it)")
        if episode_id in self.busy_episodes:
            raise RequestError(409, f"episode {episode_id} already has a request in progress; send its turns "
                                    "one after another", "episode_busy")
        self.busy_episodes.add(episode_id)
        self.idle.requested(episode_id)
        try:
            episode = self.episodes.get(episode_id)
            if episode is None:
                episode = Episode.start(self.renderer, params.messages)
            else:
                episode.extend(self.renderer, params.messages)
            self.episodes.pop(episode_id, None)  # an episode whose turn fails is discarded
            self.idle.ended(episode_id)
            prompt_ids = self._within_limit(episode.ids)
            completions = await self._generate(prompt_ids, params)
            episode.add_reply(self.renderer, completions[0])
            self.episodes[episode_id] = episode
            self.idle.answered(episode_id, client)
            return prompt_ids, completions
        except ExtensionError as err:
            raise RequestError(400, f"episode {episode_id}: {err}", "episode_mismatch") from None
        finally:
            self.busy_episodes.discard(episode_id)

    def _within_limit(self, prompt_ids: List[int]) -> List[int]:
        if len(prompt_ids) > self.limits.max_prompt_tokens:
            raise RequestError(400, f"the prompt is {len(prompt_ids)} tokens, more than this endpoint takes "
                                    f"(rollout.openai_bridge.max_prompt_tokens {self.limits.max_prompt_tokens})",
                               "context_length_exceeded")
        return prompt_ids

    async def _generate(self, prompt_ids: List[int], params: ChatParams) -> List[Completion]:
        if self._stopping:  # the worker loop no longer decodes: nothing would answer it
            raise RequestError(503, "the rollout worker stopped", "unavailable")
        future = self._loop.create_future()
        self._pending.put(_Generation(next(self._keys), prompt_ids, params, future))
        return await future

    async def _finish(self, request: web.Request) -> web.Response:
        """End an episode: its trajectory goes to the reward queue as sample `<group>/<episode id>`."""
        episode_id = request.match_info["episode_id"]
        body = await _json_body(request, self.limits.max_body_bytes) if request.can_read_body else {}
        group, row = body.get("group", episode_id), body.get("row", {})
        if not isinstance(group, str) or not isinstance(row, dict):
            raise RequestError(400, "finish takes {\"group\": a string, \"row\": an object of the row's fields}")
        self._held(episode_id)
        self.idle.requested(episode_id)
        self.idle.answered(episode_id, request.remote or "")  # kept until taken below
        try:
            position = await self._loop.run_in_executor(None, self.admit_group, group)
        except GroupEnded as ended:
            raise RequestError(410, f"{ended}; finish this episode into a new group (it is kept)",
                               "group_ended") from None
        if position is None:
            raise RequestError(429, f"group {group} cannot start: the job holds as many groups in play as "
                                    "rl.max_staleness allows; finish this episode again later (it is kept)",
                               "groups_full")
        episode = self._take(episode_id)
        sample = episode.sample(self.renderer, f"{group}/{episode_id}", group, self.policy, row, now=time.time(),
                                position=position)
        await self._loop.run_in_executor(None, self.submit, [sample])
        return web.json_response({"sample_id": sample.sample_id, "group_id": group,
                                  "completion_tokens": len(sample.completion_ids), "model_tokens": sum(episode.trace.mask)})

    async def _discard(self, request: web.Request) -> web.Response:
        """Drop an episode the agent abandoned (its rollout failed): nothing of it is trained."""
        episode_id = request.match_info["episode_id"]
        self._take(episode_id)
        return web.json_response({"discarded": episode_id})

    def _take(self, episode_id: str) -> Episode:
        """The episode, removed from those held: it ends here (finished or dropped)."""
        self._held(episode_id)
        self.idle.ended(episode_id)
        return self.episodes.pop(episode_id)

    def _not_expired(self, episode_id: str) -> None:
        if self.idle.has_expired(episode_id):
            raise RequestError(410, f"episode {episode_id} was dropped: no request of it came for longer than this "
                                    "worker's idle deadline (its agent looked gone); play it again under a new "
                                    "episode id", "episode_expired")

    async def _sweep_idle(self) -> None:
        """Every `SWEEP_EVERY_S`: drop the held episodes idle past the deadline and tell `on_expired`."""
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            expired = self.idle.expire(self.busy_episodes)
            for gone in expired:
                self.episodes.pop(gone.episode, None)
            if expired:
                try:
                    await self._loop.run_in_executor(None, self.on_expired, expired)
                except Exception as err:  # the job's Redis gone: the job ends on it; the sweep goes on meanwhile
                    print(f"openai bridge: {len(expired)} expired episodes not reported ({err})", flush=True)

    def _held(self, episode_id: str) -> None:
        """Refuses an episode this worker does not hold, or whose turn is in progress."""
        self._not_expired(episode_id)
        if episode_id in self.busy_episodes:
            raise RequestError(409, f"episode {episode_id} has a request in progress", "episode_busy")
        if episode_id not in self.episodes:
            raise RequestError(404, f"no episode {episode_id} on this worker (never started, already ended, "
                                    "or a turn of it failed)", "episode_not_found")

    def _response(self, prompt_ids: List[int], completions: List[Completion], logprobs: bool) -> Dict:
        choices = [{"index": i, "message": {"role": "assistant", "content": c.text},
                    "finish_reason": "stop" if c.completion_ids[-1] in self.stop_ids else "length",
                    "logprobs": self._logprobs(c) if logprobs else None,
                    "token_ids": c.completion_ids, "token_versions": c.versions}
                   for i, c in enumerate(completions)]
        generated = sum(len(c.completion_ids) for c in completions)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.policy, "choices": choices, "prompt_token_ids": prompt_ids,
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": generated,
                          "total_tokens": len(prompt_ids) + generated}}

    def _logprobs(self, completion: Completion) -> Dict:
        content = []
        for token_id, logprob in zip(completion.completion_ids, completion.logprobs):
            token = self.renderer.decode([token_id], special_tokens=True)
            content.append({"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []})
        return {"content": content}


def serve_worker(engine: TransformersEngine, config: OpenAIBridgeConfig, rl: RLConfig, policy: str, index: int,
                 *, chat_template: str, reward_queue: RewardQueue, counters: str,
                 admit: Callable[[str], Optional[int]], taskset: bool = False, idle_rule: Optional[HangRule] = None,
                 on_expired: Callable[[List[ExpiredEpisode]], None] = lambda expired: None) -> Optional[OpenAIBridge]:
    """Rollout worker `index`'s endpoint when `config` enables it, on port `config.port + index` (a free one
    on loopback when it is off but `taskset` asks for one: the worker's own player of a taskset); its URL
    is printed and shown by `rlp status` until it stops. Finished episodes are counted in `counters`
    (the policy's rollout stats) as they enter the reward queue; `admit` enters an agent's group into the
    job's schedule."""
    if not config.enabled:
        if not taskset:
            return None
        config = dataclasses.replace(config, enabled=True, host="127.0.0.1", port=0)
    api_key = os.environ.get(config.api_key_env) or None
    if api_key is None and not is_loopback(config.host):
        raise RuntimeError(f"rollout.openai_bridge listens on {config.host} but ${config.api_key_env} is not set "
                           "where the rollout workers run: set it to a secret key, or listen on 127.0.0.1")
    bridge = OpenAIBridge(engine, policy, chat_template, rl.temperature, rl.max_new_tokens,
                          submit=lambda samples: reward_queue.submit(samples, counters=counters), admit=admit,
                          limits=config, api_key=api_key, idle_rule=idle_rule, on_expired=on_expired)
    port = bridge.start(config.host, config.port + index if config.port else 0)
    host = ray.util.get_node_ip_address() if config.host in ("0.0.0.0", "::") else config.host
    bridge.announce(reward_queue, bridge_status_field(policy, index), f"http://{host}:{port}/v1")
    return bridge


def parse_chat(body: Dict, policy: str, temperature: float, max_new_tokens: int,
               limits: OpenAIBridgeConfig = OpenAIBridgeConfig()) -> ChatParams:
    """A chat request's parameters, checked against `limits`; unset ones take the job's rl settings."""
    if body.get("model", policy) != policy:
        raise RequestError(404, f"model '{body.get('model')}' is not served here; this worker serves '{policy}'",
                           "model_not_found")
    for name, off in _UNSUPPORTED.items():
        if body.get(name) not in (None, off, [], {}):
            raise RequestError(400, f"'{name}' is not supported by this endpoint; leave it unset")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise RequestError(400, "'messages' must be a non-empty list of {\"role\", \"content\"} with string content")
    n = _given(body, "n", 1)
    max_tokens = _given(body, "max_completion_tokens", _given(body, "max_tokens", max_new_tokens))
    temperature = _given(body, "temperature", temperature)
    if not _whole(n) or not _whole(max_tokens) or not isinstance(temperature, (int, float)) \
            or isinstance(temperature, bool) or not math.isfinite(temperature) or temperature < 0:
        raise RequestError(400, "'n' and 'max_tokens' must be positive integers and 'temperature' a finite number >= 0")
    if n > limits.max_n or max_tokens > limits.max_tokens:
        raise RequestError(400, f"'n' is at most {limits.max_n} and 'max_tokens' at most {limits.max_tokens} here "
                                "(rollout.openai_bridge.max_n, max_tokens)")
    return ChatParams([{"role": m["role"], "content": m["content"]} for m in messages], n, max_tokens,
                      float(temperature), bool(body.get("logprobs")))


def _given(body: Dict, name: str, default):
    """The request's `name`, or `default` where it is absent or null."""
    return default if body.get(name) is None else body[name]


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


async def _json_body(request: web.Request, max_bytes: int) -> Dict:
    try:
        body = await request.json()
    except ValueError:
        raise RequestError(400, "the request body is not JSON") from None
    except web.HTTPRequestEntityTooLarge:
        raise RequestError(413, f"the request body is larger than this endpoint takes ({max_bytes} "
                                "bytes: rollout.openai_bridge.max_body_bytes)", "request_too_large") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    return body


@web.middleware
async def _openai_errors(request: web.Request, handler) -> web.StreamResponse:
    """Refusals answered the way OpenAI answers them: `{"error": {message, type, param, code}}`."""
    try:
        return await handler(request)
    except RequestError as err:
        return web.json_response({"error": {"message": str(err), "type": "invalid_request_error", "param": None,
                                            "code": err.code}}, status=err.status)


def _resolve(future: asyncio.Future, completions: List[Completion]) -> None:
    if not future.done():  # the client may have gone away
        future.set_result(completions)


def _drain(pending: "queue.SimpleQueue[_Generation]") -> List[_Generation]:
    drained = []
    while not pending.empty():
        drained.append(pending.get_nowait())
    return drained
