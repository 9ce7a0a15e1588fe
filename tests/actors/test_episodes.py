"""Multi-turn episodes on a real decode batch (tiny model), real Redis and real tool workers: one
token sequence per episode, model tokens with their behaviour log-probs and observation tokens
masked out; other episodes decode while one waits on a tool; the token budget truncates; a tool
worker killed mid-call loses no episode; a one-turn episode is today's completion; a rollout worker
counts its batch's occupancy while episodes wait on a slow tool, and malformed and unknown-tool calls."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Tuple

import pytest
import torch

from rlplatform.actors.engine import TransformersEngine
from rlplatform.actors.episodes import MultiTurn, run_episodes
from rlplatform.actors.rollout import RolloutWorker
from rlplatform.actors.rollout_spec import RolloutSpec
from rlplatform.config import EnvConfig, RewardWorkersConfig, RLConfig, RolloutConfig, ToolSpec
from rlplatform.envs.rendering import Renderer
from rlplatform.envs.tool_worker import ToolWorker, job_tools_json
from rlplatform.learners.batching import completion_logprobs
from rlplatform.policy import load_tokenizer
from rlplatform.tokenization import Prompt, encode_prompts, save_prompts
from rlplatform.transport.keys import NameKeys, PolicyKeys, ToolKeys, run_scope
from rlplatform.transport.reward_queue import RewardQueue
from rlplatform.transport.tool_queue import ToolQueue
from tests.envs import tools_for_tests
from rlplatform.transport.weight_transports import ObjectStoreTransport

JOB_NAME = "episodes"
JOB = run_scope(JOB_NAME, "r1")  # the run every test here plays in
ENV = "tests.envs.tools_for_tests:CallOnce"
TOOLS = [ToolSpec(name="calculator"), ToolSpec(fn="tests.envs.tools_for_tests:wait_for_gate", timeout_s=60),
         ToolSpec(fn="tests.envs.tools_for_tests:slow_echo")]


@pytest.fixture(scope="module")
def engine(tiny_policy):
    torch.manual_seed(0)
    engine = TransformersEngine(tiny_policy)
    engine.version = 3
    return engine


def runner(engine, redis_client, max_turns=3, max_tokens=40, fn=ENV) -> MultiTurn:
    queue = ToolQueue(redis_client, JOB)
    return MultiTurn(EnvConfig(fn=fn, max_turns=max_turns, max_tokens=max_tokens, tools=TOOLS), 4,
                     Renderer(engine.tokenizer, "auto"), queue, queue.tool_keys.results("policy-0"))


def prompt(engine, text: str, **row) -> Prompt:
    return Prompt({"prompt": text, **row}, engine.tokenizer(text)["input_ids"], text)


def drive(episodes, batch, ended: dict, count: int, timeout_s: float = 120.0) -> None:
    """Step the batch and the episodes until `count` episodes have ended (into `ended`)."""
    deadline = time.monotonic() + timeout_s
    while len(ended) < count:
        ended.update(episodes.advance(batch, batch.step() if batch else []))
        assert time.monotonic() < deadline, f"only {sorted(ended)} ended in {timeout_s:g}s"
        time.sleep(0.001)


class Serving:
    """A tool worker stepping on a thread of the test process until stopped."""

    def __init__(self, redis_url: str, name: str = "worker", tools=TOOLS, claim_idle_s: float = 30.0,
                 job: str = JOB) -> None:
        self.worker = ToolWorker(name, tools, redis_url, job, RewardWorkersConfig(claim_idle_s=claim_idle_s))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            self.worker.step(block_ms=20)

    def __enter__(self) -> ToolWorker:
        self.thread.start()
        return self.worker

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def test_episode_is_one_token_sequence_with_observations_masked(engine, redis_client, redis_server):
    episodes = runner(engine, redis_client)
    with Serving(redis_server) as worker:
        (group,) = run_episodes(episodes, engine.decode_batch(4, 1.0),
                                [prompt(engine, "6*7=", tool="calculator", arguments="6*7")], 3)
    observation = engine.tokenizer("<result>42</result>", add_special_tokens=False)["input_ids"]
    for c in group:
        mask = c.completion_mask
        first = mask.index(0)
        assert mask == [1] * first + [0] * len(observation) + [1] * (len(mask) - first - len(observation))
        assert c.completion_ids[first:first + len(observation)] == observation
        assert c.logprobs[first:first + len(observation)] == [0.0] * len(observation)
        assert c.versions == [3] * len(c.completion_ids)
        assert c.episode == {"final_response": c.episode["final_response"], "turns": 2, "tool_calls": 1,
                             "truncated": False}
        # token-exact: the model's recorded log-probs are those of the whole sequence scored at once
        scores = completion_logprobs(engine.model, [c.prompt_ids], [c.completion_ids], engine.tokenizer.pad_token_id)
        width = len(c.prompt_ids) - 1
        scored = scores.logprobs[0, width:width + len(mask)].tolist()
        model = [(s, lp) for s, lp, m in zip(scored, c.logprobs, mask) if m]
        assert [s for s, _ in model] == pytest.approx([lp for _, lp in model], abs=2e-4)
    assert worker.stats.calls == 3 and worker.stats.errors == 0
    counts = episodes.take_counts()
    assert counts["episodes"] == 3 and counts["turns"] == 6 and counts["tool_calls"] == 3
    assert counts["observation_tokens"] == 3 * len(observation) and counts["episodes_truncated"] == 0
    stats = {k.decode(): float(v) for k, v in redis_client.hgetall(ToolKeys(JOB).stats).items()}
    assert stats["calls/calculator"] == 3 and stats["errors/calculator"] == 0 and stats["latency_s/calculator"] > 0


def test_other_episodes_decode_while_one_waits_on_a_tool(engine, redis_client, redis_server):
    episodes = runner(engine, redis_client)
    batch = engine.decode_batch(4, 0.0)  # greedy: no first turn ends early, the tool is called before a and b end
    episodes.start(batch, ["waits"], prompt(engine, "1+1=", tool="wait_for_gate", arguments=""))
    episodes.start(batch, ["a", "b"], prompt(engine, "2+2="))
    ended = {}
    tools_for_tests.gate.clear()
    with Serving(redis_server):
        try:
            drive(episodes, batch, ended, 2, timeout_s=60)
            assert set(ended) == {"a", "b"} and episodes.waiting == 1  # done while the call is still running
        finally:
            tools_for_tests.gate.set()
        drive(episodes, batch, ended, 3)
    assert ended["waits"].episode["tool_calls"] == 1 and ended["a"].episode["turns"] == 1


def test_token_budget_truncates_the_episode(engine, redis_client, redis_server):
    episodes = runner(engine, redis_client, max_tokens=8)  # 4 model tokens, then no room for "<result>42</result>"
    with Serving(redis_server):
        (group,) = run_episodes(episodes, engine.decode_batch(4, 1.0),
                                [prompt(engine, "6*7=", tool="calculator", arguments="6*7")], 2)
    for c in group:
        assert c.episode["truncated"] and c.episode["turns"] == 1 and c.completion_mask == [1] * len(c.completion_ids)
    assert episodes.take_counts()["episodes_truncated"] == 2


def test_a_tool_worker_killed_mid_call_loses_no_episode(engine, redis_client, redis_server):
    redis_client.set(NameKeys(JOB_NAME).newest_run, "r1")  # as the job's lease names its run: the worker finds it
    redis_client.set(ToolKeys(JOB).specs, job_tools_json(
        [ToolSpec(fn="tests.envs.tools_for_tests:slow_echo", params={"delay_s": 600})], []))
    doomed = subprocess.Popen([sys.executable, "-m", "rlplatform.cli", "tool-worker", "--redis", redis_server,
                               "--job", JOB_NAME, "--name", "doomed"], cwd=os.path.dirname(os.path.dirname(
                                   os.path.dirname(os.path.abspath(__file__)))), stderr=subprocess.DEVNULL)
    episodes = runner(engine, redis_client)
    episodes.tools.create_group()  # the job's controller does this before any worker starts
    batch = engine.decode_batch(4, 1.0)
    episodes.start(batch, ["e"], prompt(engine, "1+1=", tool="slow_echo", arguments="hi"))
    ended = {}
    try:
        deadline = time.monotonic() + 120
        while not redis_client.xpending_range(ToolKeys(JOB).requests, "tool-workers", "-", "+", 1,
                                              consumername="doomed"):
            ended.update(episodes.advance(batch, batch.step() if batch else []))
            assert time.monotonic() < deadline, "the standalone tool worker never took the call"
            time.sleep(0.05)
    finally:
        doomed.send_signal(signal.SIGKILL)
        doomed.wait()
    rescuer = [ToolSpec(fn="tests.envs.tools_for_tests:slow_echo")]
    with Serving(redis_server, "rescuer", rescuer, claim_idle_s=0.5) as worker:
        drive(episodes, batch, ended, 1)
    assert worker.stats.reclaimed == 1 and ended["e"].episode["tool_calls"] == 1
    assert "echo hi" in engine.tokenizer.decode(ended["e"].completion_ids)


def test_one_turn_episode_is_the_plain_completion(engine, redis_client):
    one_turn = runner(engine, redis_client, fn="rlplatform.envs.environment:SingleTurnEnvironment")
    p = prompt(engine, "12+30=")
    (episode,) = run_episodes(one_turn, engine.decode_batch(4, 0.0), [p], 1)[0]
    (plain,) = engine.generate([p.ids], 1, 4, 0.0)[0]
    assert episode.completion_ids == plain.completion_ids and episode.text == plain.text
    assert episode.logprobs == pytest.approx(plain.logprobs, abs=1e-6) and episode.versions == plain.versions
    assert episode.completion_mask == [1] * len(plain.completion_ids)


def test_malformed_and_unknown_tool_calls_are_counted_per_episode(engine, redis_client):
    episodes = runner(engine, redis_client, max_tokens=1000, fn="tests.envs.tools_for_tests:Scripted")
    turns = ["<tool>calculator(1", "<tool>search(x)</tool> <tool>find(y)</tool>", "<tool>calculator(", "42"]
    (group,) = run_episodes(episodes, engine.decode_batch(4, 1.0), [prompt(engine, "6*7=", turns=turns)], 1)
    assert group[0].episode["turns"] == 3 and group[0].episode["truncated"]  # max_turns ends it before "42"
    counts = episodes.take_counts()
    assert counts["malformed_calls"] == 2 and counts["unknown_tool_calls"] == 2 and counts["tool_calls"] == 0


def slow_tool_worker(tiny_policy, redis_server, redis_client, tmp_path) -> Tuple[RolloutWorker, PolicyKeys, str]:
    """A rollout worker of 2 groups of 2 episodes, each either calling a 3 s tool or talking 4 turns."""
    job = f"occupancy-{time.time_ns()}"
    RewardQueue(redis_client, job).create_group()
    ToolQueue(redis_client, job).create_group()
    rl = RLConfig(group_size=2, batch_prompts=1, max_staleness=1, max_new_tokens=4)
    rollout = RolloutConfig(prompts_per_batch=2)
    env = EnvConfig(fn="tests.envs.tools_for_tests:SlowToolOrTalk", max_turns=4, max_tokens=40, tools=SLOW)
    prompts = save_prompts(encode_prompts(load_tokenizer(tiny_policy), [{"prompt": "1+1=", "answer": "2"}], "auto"),
                           str(tmp_path / "prompts.jsonl"))
    worker = RolloutWorker(RolloutSpec(0, "policy", job, tiny_policy, prompts, redis_url=redis_server, rl=rl,
                                       rollout=rollout, env=env,
                                       dtype="float32", transport=ObjectStoreTransport()))
    worker.engine.version = 0  # 2 groups allowed in play: both start at once
    return worker, PolicyKeys(job, "policy"), job


def test_the_worker_decodes_while_episodes_wait_on_a_slow_tool(tiny_policy, redis_server, redis_client, tmp_path):
    worker, keys, job = slow_tool_worker(tiny_policy, redis_server, redis_client, tmp_path)
    loop = threading.Thread(target=worker.run, daemon=True)
    with Serving(redis_server, tools=SLOW, job=job):
        loop.start()
        try:
            deadline = time.monotonic() + 120
            while float(redis_client.hget(keys.rollout_stats, "samples") or 0) < 4:
                assert time.monotonic() < deadline and loop.is_alive(), "the worker never submitted its 2 groups"
                time.sleep(0.05)
        finally:
            worker.queue.request_stop()
            loop.join(timeout=60)
    stats = worker.counters.read()
    # a caller waited 3 s on its tool while its group's talker decoded 3 more turns: 0 were the loop to
    # block on tool results
    assert stats.decode_steps_while_waiting >= 2 and stats.sequences_while_waiting >= stats.decode_steps_while_waiting
    assert stats.idle_s_while_waiting > 0  # then only the callers were left, waiting
    assert stats.episodes == 4 and stats.tool_calls == 2 and stats.malformed_calls == 0


def test_wait_counts_after_the_last_submit_reach_redis_at_the_stop(tiny_policy, redis_server, redis_client, tmp_path):
    worker, keys, job = slow_tool_worker(tiny_policy, redis_server, redis_client, tmp_path)
    loop = threading.Thread(target=worker.run, daemon=True)
    with Serving(redis_server, tools=SLOW, job=job):
        loop.start()
        try:
            deadline = time.monotonic() + 120
            # within the tool's 3 s: the talkers decode on while callers wait, then the batch empties
            while not (worker.occupancy.counts.get("decode_steps_while_waiting", 0)
                       or worker.occupancy.counts.get("idle_s_while_waiting", 0)):
                assert time.monotonic() < deadline and loop.is_alive(), "no decode step or idle time while waiting"
                time.sleep(0.01)
        finally:
            worker.queue.request_stop()
            loop.join(timeout=60)
    stats = worker.counters.read()
    assert stats.samples == 0  # stopped before any group was submitted
    assert stats.decode_steps_while_waiting + stats.idle_s_while_waiting > 0 and stats.busy_s > 0


SLOW = [ToolSpec(fn="tests.envs.tools_for_tests:slow_echo", params={"delay_s": 3.0})]
