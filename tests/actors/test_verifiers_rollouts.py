"""Environments of the `verifiers` library played through a rollout worker's OpenAI bridge (`rlp verifiers`):
each rollout is one token-exact episode in the reward queue, grouped by task, carrying the verifiers reward
that the built-in `verifiers_reward` returns; failed rollouts leave nothing behind on the worker."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from rlplatform import cli
from rlplatform.actors.openai_bridge import OpenAIBridge
from rlplatform.rewards.verifiers import reported_reward
from rlplatform.transport.reward_queue import RewardQueue
from rlplatform.transport.samples import decode_sample
from tests.actors.test_openai_bridge import chat_policy, served  # noqa: F401 (fixtures)

pytest.importorskip("verifiers.v1")

from rlplatform.envs.verifiers_rollouts import play  # noqa: E402

# a user's taskset module: tasks "<a>+<b>=", the reward the reply's length; `two_turn_tasks` asks again
TASKSETS = '''
import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def length(self, trace: vf.Trace) -> float:
        if self.data.answer == "raise":
            raise ValueError("this task's reward fails")
        return float(len(trace.last_reply))


class SumTaskset(vf.Taskset[SumTask, vf.TasksetConfig]):
    def load(self):
        for a, b in [(1, 2), (3, 4), (5, 6)]:
            answer = "raise" if (a, b) == (ANSWER_RAISES) else str(a + b)
            yield SumTask(SumData(prompt=f"{a}+{b}=", answer=answer), self.config.task)
'''
SINGLE = TASKSETS.replace("ANSWER_RAISES", "0, 0") + '\n__all__ = ["SumTaskset"]\n'
FAILING = TASKSETS.replace("ANSWER_RAISES", "3, 4") + '\n__all__ = ["SumTaskset"]\n'
TWO_TURN = TASKSETS.replace("ANSWER_RAISES", "0, 0") + textwrap.dedent('''

    class TwoTurnConfig(vf.EnvConfig):
        agent: vf.AgentConfig = vf.AgentConfig()


    class TwoTurnEnv(vf.Env[TwoTurnConfig]):
        async def run(self, task, agents):
            async with agents.agent.interaction(task) as chat:
                await chat.turn()
                await chat.turn("again:")


    __all__ = ["SumTaskset", "TwoTurnEnv"]
    ''')


@pytest.fixture
def taskset(tmp_path, monkeypatch):
    """Writes a taskset module (a top-level module, as verifiers imports them) and returns its id."""
    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.syspath_prepend(str(tmp_path))
        return name
    return write


class Sampled(list):
    """Every reply's token ids, as the bridge sampled them, and the bridge that sampled them."""
    bridge: OpenAIBridge


@pytest.fixture
def sampled(monkeypatch) -> Sampled:
    replies, respond = Sampled(), OpenAIBridge._response

    def record(bridge, prompt_ids, completions, logprobs):
        replies.bridge = bridge
        replies.extend(c.completion_ids for c in completions)
        return respond(bridge, prompt_ids, completions, logprobs)

    monkeypatch.setattr(OpenAIBridge, "_response", record)
    return replies


def drain(queue: RewardQueue, count: int, timeout_s: float = 30.0) -> list:
    """The `count` samples of verifiers episodes that reached the reward queue (the worker's own rollouts aside)."""
    samples = []
    for _ in range(int(timeout_s / 0.2)):
        samples += [s for s in map(decode_sample, (raw for _, raw in queue.fetch("test", 50, block_ms=200)))
                    if s.group_id.startswith("vf-")]
        if len(samples) >= count:
            break
    return samples


def model_runs(sample) -> list:
    """The sample's model-token stretches (mask 1), in order."""
    runs, current = [], []
    for token, trained in zip(sample.completion_ids, sample.completion_mask):
        if trained:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def test_each_rollout_is_one_exact_episode_grouped_by_task_with_its_verifiers_reward(served, taskset, sampled):
    worker, url, queue = served
    stats = asyncio.run(play(taskset("vf_sums", SINGLE), [url], group_size=2))
    assert (stats.groups, stats.finished, stats.failed, stats.discarded) == (3, 6, 0, 0)
    samples = drain(queue, 6)
    assert len(samples) == 6
    groups = {}
    for sample in samples:
        groups.setdefault(sample.group_id, []).append(sample)
        # the bridge's sampled tokens as they were sampled, the reward verifiers computed on that reply
        assert model_runs(sample) == [sample.completion_ids] and sample.completion_ids in sampled
        # (verifiers strips the reply it hands to rewards: a sampled reply may start or end with a space)
        assert sample.row["verifiers_reward"] == len(sample.completion.strip()) == sample.row["verifiers_rewards"][
            "length"]
        assert reported_reward(sample) == sample.row["verifiers_reward"]
        assert sample.sample_id.startswith(sample.group_id + "/")
    assert sorted(len(g) for g in groups.values()) == [2, 2, 2]  # group_size rollouts per task, one group each
    assert {frozenset(s.row["answer"] for s in g) for g in groups.values()} == {
        frozenset({"3"}), frozenset({"7"}), frozenset({"11"})}
    assert stats.mean_reward == pytest.approx(sum(s.row["verifiers_reward"] for s in samples) / 6)
    assert not sampled.bridge.episodes  # every episode finished


def test_a_multi_turn_environment_is_one_trajectory_per_rollout(served, taskset, sampled):
    worker, url, queue = served
    stats = asyncio.run(play(taskset("vf_two_turns", TWO_TURN), [url], group_size=2, num_tasks=1))
    assert (stats.finished, stats.failed) == (2, 0)
    for sample in drain(queue, 2):
        first, second = model_runs(sample)  # two model turns, the re-asked question between them as observation
        assert first in sampled and second in sampled
        assert 0 in sample.completion_mask and "again:" in worker.engine.tokenizer.decode(
            [t for t, m in zip(sample.completion_ids, sample.completion_mask) if not m])


def test_a_failed_rollout_is_reported_and_leaves_no_episode_on_the_worker(served, taskset, sampled):
    worker, url, queue = served
    stats = asyncio.run(play(taskset("vf_failing", FAILING), [url], group_size=2))
    assert (stats.groups, stats.finished, stats.failed, stats.discarded) == (3, 4, 2, 2)
    assert any("this task's reward fails" in error for error in stats.errors)
    assert not sampled.bridge.episodes  # the failed rollouts' episodes were discarded, not left half-recorded
    assert sorted(s.row["answer"] for s in drain(queue, 4)) == ["11", "11", "3", "3"]


def test_a_run_ends_with_a_clear_error_once_the_bridge_stops(served, taskset):
    _, url, queue = served
    stopper = threading.Thread(target=lambda: drain(queue, 1) and queue.request_stop())  # the job ends
    stopper.start()
    with pytest.raises(ConnectionError, match=f"the OpenAI bridge at {url} stopped answering"):
        asyncio.run(play(taskset("vf_endless", SINGLE), [url], group_size=2, epochs=100))
    stopper.join()


def test_a_bridge_that_does_not_answer_is_named(taskset):
    with pytest.raises(ConnectionError, match="no OpenAI bridge answers at http://127.0.0.1:9/v1"):
        asyncio.run(play(taskset("vf_unreached", SINGLE), ["http://127.0.0.1:9/v1"], group_size=2))


def test_rlp_verifiers_plays_a_taskset_module_in_the_working_directory(served, tmp_path, monkeypatch, capsys):
    _, url, queue = served
    (tmp_path / "vf_here.py").write_text(SINGLE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert cli.main(["verifiers", "vf_here", "--url", url, "--group-size", "2", "--num-tasks", "1"]) == 0
    assert "1 tasks played, 2 episodes sent to the job" in capsys.readouterr().err
    assert len(drain(queue, 2)) == 2
    assert cli.main(["verifiers", "no_such_taskset", "--url", url, "--group-size", "2"]) == 2
    assert "taskset 'no_such_taskset' not found" in capsys.readouterr().err


def test_the_shipped_taskset_plays_through_a_bridge(served, monkeypatch, capsys):
    """examples/my_sums.py, played from outside as docs/tools-and-environments.md's `rlp verifiers` line does: its episodes carry
    the task's answer and the verifiers score; configs/verifiers_sums.yaml plays it as the job's own source."""
    from rlplatform.config import load_config

    _, url, queue = served
    repo = Path(__file__).resolve().parents[2]
    config = load_config(str(repo / "configs" / "verifiers_sums.yaml"))
    assert config.env.kind == "verifiers" and config.env.taskset == "examples/my_sums.py"
    monkeypatch.chdir(repo / "examples")
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert cli.main(["verifiers", "my_sums", "--url", url, "--group-size", "2", "--num-tasks", "1"]) == 0
    assert "1 tasks played, 2 episodes sent to the job" in capsys.readouterr().err
    episodes = drain(queue, 2)
    first, second = episodes[0].row["prompt"].rstrip("=").split("+")  # the taskset's first task: "<a>+<b>="
    assert all(e.row["answer"] == str(int(first) + int(second)) and e.row["verifiers_reward"] in (0.0, 1.0)
               for e in episodes)
